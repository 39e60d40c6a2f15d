"""The repository's package, seen from the verdict side through a pipe: calls cross, code does not.

The ``repo`` family's judged run (:mod:`rlstream.envs.repo_driver`) runs pytest and the task's
pristine tests in the verdict side, and the patched package in the answer's process. This file
(standard library only; the driver program is this file followed by the driver) is both ends:

- the answer's end, :func:`serve`: imports what the verdict side names, keeps every object it
  hands out in a table, and answers one request at a time (get or set an attribute, call, an
  operator, ``next``, ``isinstance``);
- the verdict side's end, :class:`Bridge` and the proxies: ``import PKG`` of a repository module
  yields a :class:`RemoteModule`, and what it hands out is a :class:`Remote` (a handle), a fresh
  copy of plain data, a :class:`RemoteTzinfo` (a ``datetime.tzinfo`` whose answers come from the
  package), or, for an exception class, a local class of the same name whose bases are the
  builtin exceptions it derives from (so ``pytest.raises(pkg.Error)`` and ``except ValueError``
  work). An exception raised in the package is raised again here as such a class.

Rules that make the verdict unforgeable: frames are length-prefixed JSON (at most
``MAX_FRAME`` bytes) and :func:`decode` builds only builtin and ``datetime``/``decimal``/
``fractions`` values, proxies and mirror classes, never an object the answer chose, so nothing
the package sends runs code on the verdict side; the tests, the runner and the outcomes live only
there. ``StopIteration``/``StopAsyncIteration`` raised by the package become ``RuntimeError``
(PEP 479), except from ``next``. What crosses by value is a copy: a list the package hands out
by attribute crosses as a handle, so mutating it reaches the package.
"""

import builtins
import datetime
import decimal
import fractions
import json
import operator
import struct
import types

MAX_FRAME = 1 << 24


def _words(text):
    return text.split()


_SEQ = {"tuple": tuple, "set": set, "frozenset": frozenset}
_BY_VALUE = (type(None), bool, int, float, str)
_UNARY = {
    "repr": repr, "str": str, "hash": hash, "len": len, "bool": bool, "iter": iter,
    "int": int, "float": float, "complex": complex, "index": operator.index, "dir": dir,
    "neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
    "reversed": reversed, "round": round,
}  # fmt: skip
_BINARY = {
    name: getattr(operator, name)
    for name in _words(
        "eq ne lt le gt ge add sub mul truediv floordiv mod pow matmul and_ or_ xor "
        "lshift rshift contains getitem delitem"
    )
}
_BINARY.update({"divmod": divmod, "format": format,
                "isinstance_of": lambda cls, obj: isinstance(obj, cls),
                "subclass_of": lambda cls, sub: issubclass(sub, cls)})  # fmt: skip
_BINARY.update({"r" + name: (lambda f: lambda a, b: f(b, a))(_BINARY[name])
                for name in _words("add sub mul truediv floordiv mod pow matmul and_ or_ xor lshift "
                "rshift divmod")})  # fmt: skip


class BridgeError(RuntimeError):
    """The package's process is gone or sent something that is not a frame."""


def write_frame(fd, obj):
    import os

    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read_frame(fd):
    import os

    def exactly(n):
        data = b""
        while len(data) < n:
            chunk = os.read(fd, min(n - len(data), 1 << 20))
            if not chunk:
                raise BridgeError("the package's process ended")
            data += chunk
        return data

    (size,) = struct.unpack(">I", exactly(4))
    if size > MAX_FRAME:
        raise BridgeError(f"a frame of {size} bytes is over the limit")
    return json.loads(exactly(size))


def _builtin_name(value):
    name = getattr(value, "__name__", None)
    if type(name) is str and getattr(builtins, name, None) is value:
        return name
    return None


def encode(value, ref, depth=0):
    """Tagged JSON of ``value``: plain data by value, else ``ref(value)`` (a handle's tree)."""
    if type(value) in _BY_VALUE:
        return value
    if depth > 40:
        return ref(value)
    t = type(value)
    if t is list:
        return [encode(v, ref, depth + 1) for v in value]
    if t in (tuple, set, frozenset):
        return {t.__name__: [encode(v, ref, depth + 1) for v in value]}
    if t is dict:
        return {"dict": [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)]
                         for k, v in value.items()]}  # fmt: skip
    if t is bytes:
        return {"bytes": value.hex()}
    if t is complex:
        return {"complex": [value.real, value.imag]}
    if t is slice:
        return {"slice": [encode(v, ref, depth + 1) for v in (value.start, value.stop, value.step)]}
    if t is decimal.Decimal:
        return {"decimal": str(value)}
    if t is fractions.Fraction:
        return {"fraction": [value.numerator, value.denominator]}
    if t is datetime.timedelta:
        return {"timedelta": [value.days, value.seconds, value.microseconds]}
    if t is datetime.date:
        return {"date": [value.year, value.month, value.day]}
    if t in (datetime.datetime, datetime.time):
        fields = ("year", "month", "day") if t is datetime.datetime else ()
        fields += ("hour", "minute", "second", "microsecond", "fold")
        tz = encode(value.tzinfo, ref, depth + 1)
        return {t.__name__: [getattr(value, f) for f in fields] + [tz]}
    if t is datetime.timezone:
        offset = value.utcoffset(None)
        return {"timezone": [encode(offset, ref), value.tzname(None)]}
    if value is Ellipsis:
        return {"ellipsis": 0}
    name = _builtin_name(value)
    if name is not None:
        return {"builtin": name}
    return ref(value)


def decode(tree, deref, depth=0):
    """The value :func:`encode` made, handles through ``deref``; ValueError when malformed."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if depth > 45:
        raise ValueError("nested too deeply")
    if type(tree) is list:
        return [decode(v, deref, depth + 1) for v in tree]
    if type(tree) is not dict or len(tree) != 1:
        raise ValueError("not an encoded value")
    ((tag, body),) = tree.items()
    if tag in _SEQ and type(body) is list:
        return _SEQ[tag](decode(v, deref, depth + 1) for v in body)
    if tag == "dict" and type(body) is list:
        return {decode(k, deref, depth + 1): decode(v, deref, depth + 1) for k, v in body}
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex":
        return complex(float(body[0]), float(body[1]))
    if tag == "slice":
        return slice(*(decode(v, deref, depth + 1) for v in body))
    if tag == "decimal" and type(body) is str:
        return decimal.Decimal(body)
    if tag == "fraction":
        return fractions.Fraction(int(body[0]), int(body[1]))
    if tag == "timedelta":
        return datetime.timedelta(*(int(v) for v in body))
    if tag == "date":
        return datetime.date(*(int(v) for v in body))
    if tag in ("datetime", "time"):
        *fields, fold, tz = body
        tz = decode(tz, deref, depth + 1)
        kind = datetime.datetime if tag == "datetime" else datetime.time
        return kind(*(int(v) for v in fields), tzinfo=tz, fold=int(fold))
    if tag == "timezone":
        offset = decode(body[0], deref, depth + 1)
        return datetime.timezone(offset) if body[1] is None else datetime.timezone(offset, body[1])
    if tag == "ellipsis":
        return Ellipsis
    if tag == "builtin" and type(body) is str:
        value = getattr(builtins, body, None)
        if isinstance(value, type) or type(value) is type(len):
            return value
        raise ValueError(f"not a builtin: {body!r}")
    return deref(tag, body)


# -- the answer's end ----------------------------------------------------------------------


_STOP = object()  # ``next`` found the iterator exhausted


class _Table:
    """The answer's end: every object handed out, kept alive so that its number stays its own;
    the verdict side's objects it was given (:class:`Local`); the pipes."""

    def __init__(self, requests, replies):
        self.requests, self.replies = requests, replies
        self.objects = []
        self.numbers = {}
        self.locals = {}

    def ref(self, value):
        if isinstance(value, Local):
            return {"local": object.__getattribute__(value, "_rl_id")}
        n = self.numbers.get(id(value))
        if n is None:
            n = self.numbers[id(value)] = len(self.objects)
            self.objects.append(value)
        if isinstance(value, type) and issubclass(value, BaseException):
            bases = [b for b in value.__mro__[1:] if issubclass(b, BaseException)]
            return {"exc_class": [n, value.__name__, [self.ref_or_builtin(b) for b in bases[:1]]]}
        if isinstance(value, datetime.tzinfo):
            return {"tzinfo": n}
        return {"ref": n}

    def ref_or_builtin(self, cls):
        name = _builtin_name(cls)
        return {"builtin": name} if name else self.ref(cls)

    def deref(self, tag, body):
        if tag == "local" and type(body) is int:
            if body not in self.locals:
                self.locals[body] = Local(self, body)
            return self.locals[body]
        if tag == "ref" and type(body) is int and 0 <= body < len(self.objects):
            return self.objects[body]
        raise ValueError(f"no such handle: {tag} {body!r}")

    def callback(self, n, op, *args):
        """Ask the verdict side for ``op`` on its object ``n`` (plain data comes back)."""
        write_frame(self.replies, {"callback": [n, op, encode(list(args), self.ref)]})
        reply = read_frame(self.requests)
        while type(reply) is dict and "op" in reply:  # the verdict side asks while it answers
            write_frame(self.replies, _answer(self, reply))
            reply = read_frame(self.requests)
        if reply.get("not_implemented") is True:
            return NotImplemented
        if "ok" in reply:
            return decode(reply["ok"], self.deref)
        kind = getattr(builtins, str(reply.get("raise", "")), None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = RuntimeError
        raise kind(str(reply.get("text", "")))


class Local:
    """An object of the tests given to the package: a few operations, answered by the tests."""

    def __init__(self, table, n):
        object.__setattr__(self, "_rl_table", table)
        object.__setattr__(self, "_rl_id", n)


def _local_op(op):
    def method(self, *args):
        table = object.__getattribute__(self, "_rl_table")
        return table.callback(object.__getattribute__(self, "_rl_id"), op, *args)

    return method


LOCAL_OPS = _words("index int float str repr hash bool len eq ne lt le gt ge call")
for _op in LOCAL_OPS:
    setattr(Local, f"__{_op}__", _local_op(_op))


def _subclass(table, req):
    """A class the tests define on a class of the package, made here from the tests' source."""
    namespace = decode(req["namespace"], table.deref)
    namespace["__name__"] = "tests"
    exec(compile(str(req["source"]), "<a class of the tests>", "exec"), namespace)
    return namespace[str(req["name"])]


def _reply(table, op, req):
    """One request's result (module rules); raises what the package raised."""
    import importlib

    def arg(key):
        return decode(req[key], table.deref)

    if op == "import":
        return importlib.import_module(str(req["name"]))
    if op == "subclass":
        return _subclass(table, req)
    target = arg("target")
    if op == "getattr":
        return getattr(target, str(req["name"]))
    if op == "setattr":
        return setattr(target, str(req["name"]), arg("value"))
    if op == "delattr":
        return delattr(target, str(req["name"]))
    if op == "call":
        return target(*arg("args"), **{str(k): v for k, v in arg("kwargs").items()})
    if op == "next":
        return next(target, _STOP)
    if op == "setitem":
        return operator.setitem(target, arg("key"), arg("value"))
    if op in ("copy", "deepcopy"):
        import copy

        return getattr(copy, op)(target)
    if op in _UNARY:
        return _UNARY[op](target)
    if op in _BINARY:
        return _BINARY[op](target, arg("other"))
    raise ValueError(f"no such operation: {op!r}")


def serve(requests, replies):
    """The answer's end: answer requests until the verdict side closes its pipe."""
    table = _Table(requests, replies)
    while True:
        try:
            req = read_frame(requests)
        except BridgeError:
            return
        write_frame(replies, _answer(table, req))


def _answer(table, req):
    """The reply to one request: its result, or what the package raised, and its warnings."""
    import warnings

    op = req.get("op")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = _reply(table, op, req)
            if value is _STOP:
                out = {"stop": True}
            elif op == "getattr" and type(value) in (list, dict, set):
                out = {"ok": table.ref(value)}  # the package's own container, not a copy
            else:
                out = {"ok": encode(value, table.ref)}
        except BaseException as exc:  # the package's, raised again on the verdict side
            if isinstance(exc, (StopIteration, StopAsyncIteration)):
                exc = RuntimeError(f"{type(exc).__name__} raised by the package (PEP 479)")
            try:
                args = encode(exc.args, table.ref)
            except Exception:  # args that cannot cross: the message stands for them
                args = None
            out = {"raise": [table.ref_or_builtin(type(exc)), args, _text(exc)]}
    out["warnings"] = [[table.ref_or_builtin(w.category), _text(w.message)] for w in caught]
    return out


def _text(exc):
    try:
        return str(exc)[:4000]
    except Exception:
        return type(exc).__name__


# -- the verdict side's end ----------------------------------------------------------------


class Bridge:
    """The verdict side's pipe pair to :func:`serve`, and the proxies of what it handed out."""

    def __init__(self, to_answer, from_answer):
        self.to_answer, self.from_answer = to_answer, from_answer
        self.proxies = {}
        self.locals = {}  # number -> an object of the tests the package was given
        self.broken = None

    def ask(self, op, target=None, **args):
        """``op`` on handle number ``target``: its result, or what the package raised."""
        import warnings

        if self.broken:
            raise BridgeError(self.broken)
        req = {"op": op, **{k: encode(v, self.ref) for k, v in args.items()}}
        if target is not None:
            req["target"] = {"ref": target}
        try:
            write_frame(self.to_answer, req)
            reply = read_frame(self.from_answer)
            while type(reply) is dict and "callback" in reply:
                write_frame(self.to_answer, self.callback(reply["callback"]))
                reply = read_frame(self.from_answer)
        except (OSError, BridgeError, ValueError) as exc:
            self.broken = f"the package's process is gone ({exc})"
            raise BridgeError(self.broken) from None
        try:
            for category, text in reply.get("warnings", [])[:100]:
                kind = decode(category, self.proxy)
                if isinstance(kind, type) and issubclass(kind, Warning):
                    warnings.warn(str(text), kind, stacklevel=3)
            if reply.get("stop") is True:
                problem = StopIteration()
            elif "ok" in reply:
                return decode(reply["ok"], self.proxy)
            else:
                problem = self.exception(reply["raise"])
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise BridgeError(f"a malformed reply from the package ({exc})") from None
        raise problem

    def ref(self, obj):
        """What stands for ``obj`` on the wire: a handle of the package's, or one of ours."""
        n = obj.__dict__.get("_rl_id") if isinstance(obj, type) else None
        if n is None and isinstance(obj, (Remote, RemoteModule)):
            n = object.__getattribute__(obj, "_rl_id")
        if type(n) is int:
            return {"ref": n}
        key = len(self.locals)
        self.locals[key] = obj
        return {"local": key}

    def callback(self, body):
        """The package asks about an object of the tests it holds: only ``LOCAL_OPS``."""
        try:
            n, op, args = body
            obj = self.locals[n]
            if op not in LOCAL_OPS:
                raise ValueError(f"no such operation on an object of the tests: {op!r}")
            args = decode(args, self.proxy)
            if op == "call":
                value = obj(*args)
            elif op in _COMPARE:  # the object's own method only: the package's Python reflects
                value = getattr(type(obj), f"__{op}__")(obj, *args)
                if value is NotImplemented:  # (reflecting here too would ping-pong for ever)
                    return {"not_implemented": True}
            else:
                value = _LOCAL[op](obj)
            return {"ok": encode(value, self.ref)}
        except Exception as exc:
            name = type(exc).__name__ if _builtin_name(type(exc)) else "RuntimeError"
            return {"raise": name, "text": _text(exc)}

    def proxy(self, tag, body):
        """The local stand-in for a handle (one per handle, so ``is`` holds)."""
        if tag == "local" and type(body) is int and body in self.locals:
            return self.locals[body]
        n = body[0] if tag == "exc_class" and type(body) is list else body
        if type(n) is not int or tag not in ("ref", "tzinfo", "exc_class"):
            raise ValueError(f"not a handle: {tag}")
        if n not in self.proxies:
            if tag == "exc_class":
                self.proxies[n] = self._mirror(n, body)
            else:
                self.proxies[n] = (RemoteTzinfo if tag == "tzinfo" else Remote)(self, n)
        return self.proxies[n]

    def _mirror(self, n, body):
        """A local exception class standing for the package's class ``n``."""
        _, name, bases = body
        local = tuple(decode(b, self.proxy) for b in bases)
        if not local or not all(isinstance(b, type) and issubclass(b, Exception) for b in local):
            local = (Exception,)
        return type(str(name), local, {"_rl_id": n, "__str__": _mirror_text})

    def exception(self, body):
        """The local exception for a ``raise`` reply: only an ``Exception`` ever."""
        kind, args, text = body
        cls = decode(kind, self.proxy)
        args = tuple(decode(args, self.proxy)) if args is not None else (str(text),)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            return RuntimeError(f"the package raised {getattr(cls, '__name__', '?')}: {text}")
        try:
            exc = cls(*args)
        except Exception:
            exc = cls(str(text))
        if "_rl_id" in cls.__dict__:
            exc._rl_text = str(text)
        return exc


_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
_LOCAL = {"index": operator.index, "int": int, "float": float, "str": str, "repr": repr,
          "hash": hash, "bool": bool, "len": len}  # fmt: skip


def _mirror_text(self):
    return getattr(self, "_rl_text", None) or Exception.__str__(self)


def _ask(proxy, op, **args):
    bridge = object.__getattribute__(proxy, "_rl_bridge")
    return bridge.ask(op, object.__getattribute__(proxy, "_rl_id"), **args)


class Remote:
    """An object of the package, in the answer's process: every use is a request."""

    def __init__(self, bridge, n):
        object.__setattr__(self, "_rl_bridge", bridge)
        object.__setattr__(self, "_rl_id", n)

    def __getattr__(self, name):
        return _ask(self, "getattr", name=name)

    def __setattr__(self, name, value):
        _ask(self, "setattr", name=name, value=value)

    def __delattr__(self, name):
        _ask(self, "delattr", name=name)

    def __call__(self, *args, **kwargs):
        return _ask(self, "call", args=list(args), kwargs=kwargs)

    def __repr__(self):
        return _ask(self, "repr")

    def __str__(self):
        return _ask(self, "str")

    def __format__(self, spec):
        return _ask(self, "format", other=spec)

    def __hash__(self):
        return _ask(self, "hash")

    def __bool__(self):
        return _ask(self, "bool")

    def __len__(self):
        return _ask(self, "len")

    def __iter__(self):
        return _ask(self, "iter")

    def __next__(self):
        return _ask(self, "next")

    def __reversed__(self):
        return _ask(self, "reversed")

    def __setitem__(self, key, value):
        _ask(self, "setitem", key=key, value=value)

    def __instancecheck__(self, obj):
        return _ask(self, "isinstance_of", other=obj)

    def __subclasscheck__(self, cls):
        return _ask(self, "subclass_of", other=cls)

    def __dir__(self):
        return _ask(self, "dir")

    def __copy__(self):
        return _ask(self, "copy")

    def __deepcopy__(self, memo):
        return _ask(self, "deepcopy")

    def __reduce_ex__(self, protocol):
        raise TypeError("an object of the package cannot be pickled on the verdict side")

    def __mro_entries__(self, bases):
        return (_Subclassed,)


def _method(op):
    return lambda self, *args: _ask(self, op, **({"other": args[0]} if args else {}))


for _op in _words("int float complex index neg pos abs invert round"):
    setattr(Remote, f"__{_op}__", _method(_op))
for _op in _words("eq ne lt le gt ge contains getitem delitem"):
    setattr(Remote, f"__{_op}__", _method(_op))
for _op in _words("add sub mul truediv floordiv mod pow matmul and or xor lshift rshift divmod"):
    _name = _op + "_" if _op in ("and", "or") else _op
    setattr(Remote, f"__{_op}__", _method(_name))
    setattr(Remote, f"__r{_op}__", _method("r" + _name))


class _Subclassing(type):
    """``class X(PackageClass): ...`` in a test: the class is made in the package's process from
    the statement's source (the tests' own, read from their file here) and X is its proxy."""

    def __new__(mcls, name, bases, namespace):
        import ast
        import sys

        frame = sys._getframe(1)
        remote = [b for b in namespace.get("__orig_bases__", ()) if isinstance(b, Remote)]
        with open(frame.f_code.co_filename, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        here = frame.f_lineno
        found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name
                 and min([n.lineno] + [d.lineno for d in n.decorator_list]) <= here
                 <= n.end_lineno]  # fmt: skip
        if not found or not remote:
            raise TypeError(f"class {name}: its source cannot be found to make it in the package")
        node = min(found, key=lambda n: n.end_lineno - n.lineno)
        node.bases = [ast.Name(f"_rl_base{i}", ast.Load()) for i in range(len(remote))]
        node.decorator_list, node.keywords = [], []
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        scope = {**frame.f_globals, **frame.f_locals}
        given = {k: scope[k] for k in names if k in scope and not k.startswith("__")}
        given.update({f"_rl_base{i}": b for i, b in enumerate(remote)})
        bridge = object.__getattribute__(remote[0], "_rl_bridge")
        source = ast.unparse(ast.Module([node], []))
        return bridge.ask("subclass", name=name, source=source, namespace=given)


_Subclassed = type.__new__(_Subclassing, "_Subclassed", (), {})


class RemoteTzinfo(Remote, datetime.tzinfo):
    """A time zone of the package: ``datetime`` takes it, its answers come from the package."""

    def utcoffset(self, dt):
        return _ask(self, "getattr", name="utcoffset")(dt)

    def dst(self, dt):
        return _ask(self, "getattr", name="dst")(dt)

    def tzname(self, dt):
        return _ask(self, "getattr", name="tzname")(dt)

    def fromutc(self, dt):
        return _ask(self, "getattr", name="fromutc")(dt)


class RemoteModule(types.ModuleType):
    """A module of the repository, imported in the answer's process."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name != "__all__":
            raise AttributeError(name)  # the import system's own probes stay local
        return _ask(self, "getattr", name=name)

    def __setattr__(self, name, value):
        if name.startswith("__") or isinstance(value, RemoteModule):  # the import system's
            object.__setattr__(self, name, value)
        else:
            _ask(self, "setattr", name=name, value=value)

    def __delattr__(self, name):
        _ask(self, "delattr", name=name)


class RemoteFinder:
    """A ``sys.meta_path`` finder: the repository's own modules come from the package's process."""

    def __init__(self, bridge, tops):
        self.bridge, self.tops = bridge, frozenset(tops)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.tops:
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = RemoteModule(spec.name)
        handle = self.bridge.ask("import", name=spec.name)
        object.__setattr__(module, "_rl_bridge", self.bridge)
        object.__setattr__(module, "_rl_id", object.__getattribute__(handle, "_rl_id"))
        return module

    def exec_module(self, module):
        return None
