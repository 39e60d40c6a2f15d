"""Multi-turn rollout harness: the policy may run code before it answers.

The policy generates until its final answer or ``</run>``; a ``<run>CALL</run>`` block is one tool
call of the task's environment, whose output the harness appends as ``<out>OUTPUT</out>``, up to
``max_turns`` calls. Each sample has its own workspace. Tool calls may also go in a chat
template's own format (:mod:`rlstream.rollout.toolcalls`).

Rules a maintainer must keep:
- every token is processed by the model exactly once, and ``token_ids``, ``logprobs``,
  ``loss_mask``, ``routes`` and ``versions`` stay aligned position by position; an expert id is
  never wrapped to fit;
- continuations reuse the KV cache, so the recorded routes are the ones that produced the tokens;
- context overflow starts a new, self-contained segment from a compaction prompt;
- every call is recorded and counts toward ``max_turns``, failed or not;
- a reclaim (``preempt``, or an engine's ``cut``) stops the group between two sampling steps or
  two turns and raises ``Preempted`` with every sample's state (``rollout.checkpoint``);
  ``group(..., resume=checkpoint)`` goes on from there without generating a token twice.

Details: docs/environments.md (The rollout harness).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from rlstream.envs.tools import Environment, Workspace, code_only
from rlstream.rollout.checkpoint import GroupCheckpoint, Preempted, RowState
from rlstream.rollout.config import HarnessConfig
from rlstream.rollout.engines import Engine, GenerateFn, Prior, TorchEngine
from rlstream.rollout.model import Generation, PolicyModel, generate, inference_copy
from rlstream.rollout.toolcalls import Call, format_for
from rlstream.schemas import arrays
from rlstream.schemas.errors import RlstreamError


class PromptTooLong(RlstreamError, ValueError):
    """The prompt leaves no room to generate in the policy's context window."""


@dataclass
class Segment:
    """``[start, end)`` of a sample's flat arrays: one context the learner replays on its own."""

    start: int
    end: int
    turns: int
    reason: Literal["final", "compacted", "truncated"]


@dataclass
class Sample:
    """One rollout (see the module docstring for the array rules).

    ``completion`` is the text the policy produced in its last segment (tool calls and
    observations included; the family's ``answer`` extracts the answer). ``timings`` has
    ``generate_s`` (the batched first turn counts in full for every sample) and ``tool_s``.
    ``tool_calls`` records every call (see the module rules).
    """

    index: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    routes: np.ndarray  # uint8 or uint16 by the policy's expert count (see the module rules)
    versions: np.ndarray  # int64 [T]: the version that processed each token (module rules)
    segments: list[Segment]
    completion: str
    turns: int
    finished: bool
    timings: dict[str, float] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: int = 0
    summaries: list[str] = field(default_factory=list)  # the policy's own, one per compaction


@dataclass
class _Row:
    """Mutable per-sample state while rolling out."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    seg_start: int = 0
    seg_prompt: int = 0  # flat offset where the current segment's generated text begins
    turns: int = 0
    outputs: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0})
    workspace: Workspace = field(default_factory=Workspace)
    calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: int = 0
    transcript: list[str] = field(default_factory=list)  # the segment's turns, outputs in <out>
    summaries: list[str] = field(default_factory=list)  # what the policy wrote when compacting
    replay: list[dict[str, Any]] = field(default_factory=list)  # calls that ran, full inputs
    turn: list[int] = field(default_factory=list)  # the turn taken so far
    open: bool = False  # that turn was cut part-way
    done: bool = False
    pending: tuple[Generation, int] | None = None  # a generation (and its row) not taken yet
    gen: tuple[Generation, int] | None = None  # the last one, whose cache holds the segment

    def feed(self, ids: list[int], routes: np.ndarray, versions: list[int]) -> None:
        """Append context tokens the policy did not generate."""
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.routes.append(routes)
        self.versions += versions

    def emit(
        self, ids: list[int], logprobs: list[float], routes: np.ndarray, versions: list[int]
    ) -> None:
        """Append tokens the policy generated."""
        self.tokens += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)
        self.routes.append(routes)
        self.versions += versions

    def close(self, reason: Literal["final", "compacted", "truncated"]) -> None:
        self.segments.append(Segment(self.seg_start, len(self.tokens), self.turns, reason))
        self.seg_start = len(self.tokens)
        if reason == "compacted":
            self.transcript = []
        else:
            self.done = True

    def state(self) -> RowState:
        """The row as checkpoint data (``rollout.checkpoint``)."""
        return RowState(
            tokens=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            mask=np.asarray(self.mask, dtype=np.uint8),
            routes=np.concatenate(self.routes, axis=0),
            versions=np.asarray(self.versions, dtype=np.int64),
            segments=[[g.start, g.end, g.turns, g.reason] for g in self.segments],
            seg_start=self.seg_start,
            seg_prompt=self.seg_prompt,
            turns=self.turns,
            outputs=list(self.outputs),
            timings=dict(self.timings),
            calls=list(self.calls),
            tool_errors=self.tool_errors,
            transcript=list(self.transcript),
            summaries=list(self.summaries),
            replay=list(self.replay),
            turn=list(self.turn),
            open=self.open,
            done=self.done,
        )

    @classmethod
    def of_state(cls, st: RowState, workspace: Workspace) -> _Row:
        """A row from checkpoint data, with ``workspace`` (already rebuilt by the caller)."""
        return cls(
            tokens=st.tokens.astype(np.int64).tolist(),
            logprobs=st.logprobs.astype(np.float64).tolist(),
            mask=st.mask.astype(np.int64).tolist(),
            routes=[st.routes],
            versions=st.versions.tolist(),
            segments=[Segment(int(a), int(b), int(t), r) for a, b, t, r in st.segments],
            seg_start=st.seg_start,
            seg_prompt=st.seg_prompt,
            turns=st.turns,
            outputs=list(st.outputs),
            timings={"generate_s": 0.0, "tool_s": 0.0, **st.timings},
            workspace=workspace,
            calls=list(st.calls),
            tool_errors=st.tool_errors,
            transcript=list(st.transcript),
            summaries=list(st.summaries),
            replay=list(st.replay),
            turn=list(st.turn),
            open=st.open,
            done=st.done,
        )


class _Reclaimed(RlstreamError):
    """Raised inside the harness when a reclaim stops the group (caught by ``group``)."""


def _routes(gen: Generation, row: int, n: int, offset: int, expert_bytes: int) -> np.ndarray:
    """Routes of ``n`` fed tokens from ``offset`` as expert ids ``expert_bytes`` wide (checked)."""
    return arrays.expert_ids(gen.routes[row, offset : offset + n].numpy(), expert_bytes)


def version_spans(versions: np.ndarray, default: int) -> list[dict[str, int]]:
    """A sample's per-token versions as spans ``{version, token_start, token_end}``: maximal
    runs of one version, in token order, covering every token; -1 (an engine that reports no
    versions) reads as ``default``. A sample of no token is one empty span of ``default``."""
    known = np.where(versions < 0, default, versions)
    if known.size == 0:
        return [{"version": int(default), "token_start": 0, "token_end": 0}]
    cuts = [0, *(np.flatnonzero(np.diff(known)) + 1).tolist(), int(known.size)]
    return [
        {"version": int(known[a]), "token_start": int(a), "token_end": int(b)}
        for a, b in itertools.pairwise(cuts)
    ]


def _versions(gen: Generation, row: int, n: int, offset: int) -> list[int]:
    """Versions of ``n`` positions from ``offset`` (-1 each when the engine reports none)."""
    if gen.versions is None:
        return [-1] * n
    return [int(v) for v in gen.versions[row, offset : offset + n]]


def tool_details(sample: Sample, max_output_chars: int = 1000) -> dict[str, str]:
    """A sample's tool calls for the trajectory's ``outcome.details`` (``tool_calls``: JSON)."""
    if not sample.tool_calls:
        return {}
    calls = [
        {**c, "output": str(c.get("output", ""))[:max_output_chars]} for c in sample.tool_calls
    ]
    return {"tool_calls": json.dumps(calls)}


SUMMARY_REQUEST = "context full: summarise your progress"


def _compaction_prompt(
    prompt: str, row: _Row, cfg: HarnessConfig, written: str | None = None
) -> str:
    """The next segment's prompt: the policy's ``written`` summary and the last output, else a
    deterministic digest (how many runs, and the tail of the last output)."""
    last = row.outputs[-1] if row.outputs else ""
    if written is None:
        summary = f"{row.turns} runs; last: {last}"[: cfg.summary_chars]
    else:
        summary = written[: cfg.summary_chars] + f"; last: {last}"[: cfg.summary_chars]
    return f"{prompt}<sum>{summary}</sum>"


class Rollout:
    """Rolls out groups of samples for prompts with one policy."""

    def __init__(
        self,
        model: PolicyModel,
        cfg: HarnessConfig,
        generate_fn: GenerateFn = generate,
        engine: Engine | None = None,
        preempt: Callable[[], bool] | None = None,
    ) -> None:
        """``engine`` None: the ``torch`` engine on ``model`` (in ``cfg.inference_dtype``) with
        ``generate_fn``; otherwise ``model`` gives only the shape (window, expert width).
        ``preempt`` is asked between two turns: True stops the group (``Preempted``)."""
        self.cfg = cfg
        self.preempt = preempt
        self.model = model
        if engine is None:
            dtype = torch.bfloat16 if cfg.inference_dtype == "bfloat16" else torch.float32
            if next(model.parameters()).dtype != dtype:
                self.model = inference_copy(model, dtype)
            engine = TorchEngine(self.model, generate_fn)
        self.engine = engine
        self.window = model.cfg.max_seq_len
        self.text = model.text  # the policy's own tokenizer (rollout.text)
        self.expert_bytes = arrays.expert_bytes_for(model.cfg.n_experts)
        self.env = code_only()
        self.fmt = format_for(self.text)

    def group(
        self,
        prompt: str,
        group_size: int,
        generator: torch.Generator,
        env: Environment | None = None,
        resume: GroupCheckpoint | None = None,
    ) -> list[Sample]:
        """``group_size`` samples for ``prompt`` in ``env`` (default: one tool, Python code);
        the first turn runs as one batch. With ``resume``, the group goes on from that
        checkpoint (its prompt and size are the checkpoint's). A reclaim raises ``Preempted``."""
        self.env = env or code_only()
        self.tools = self.env.schemas() if self.fmt.offers_schemas else None
        if hasattr(self.engine, "tools"):  # an engine that forwards them (the OpenAI field)
            self.engine.tools = self.tools
        if resume is not None:
            prompt = resume.prompt
            rows = [self._restore(state) for state in resume.rows]
        else:
            rows = self._first_turn(prompt, group_size, generator)
        for b, row in enumerate(rows):
            try:
                self._finish(row, prompt, generator)
            except _Reclaimed:
                for rest in rows[b + 1 :]:
                    if rest.pending is not None:
                        self._take(rest)
                raise Preempted(GroupCheckpoint(prompt, [r.state() for r in rows])) from None
        return [self._sample(b, row) for b, row in enumerate(rows)]

    def _first_turn(self, prompt: str, group_size: int, generator: torch.Generator) -> list[_Row]:
        """The group's first turn, one batch: a row per sample, its turn not taken yet."""
        ids = self.text.prompt(prompt, self.tools)
        if len(ids) >= self.window:
            raise PromptTooLong(
                f"prompt of {len(ids)} tokens leaves no room in the policy's window of {self.window}"
            )
        started = time.perf_counter()
        gen = self._generate(torch.tensor([ids] * group_size), generator, None)
        first_s = time.perf_counter() - started
        rows = []
        for b in range(group_size):
            row = _Row(workspace=self.env.workspace())
            row.feed(
                ids, _routes(gen, b, len(ids), 0, self.expert_bytes), _versions(gen, b, len(ids), 0)
            )
            row.seg_prompt = len(ids)
            row.timings["generate_s"] += first_s
            row.pending = (gen, b)
            rows.append(row)
        return rows

    def _restore(self, state: RowState) -> _Row:
        """A checkpointed row, its workspace rebuilt by running its calls again in order."""
        started = time.perf_counter()
        workspace = self.env.workspace()
        for call in state.replay:
            box = self.cfg.tool_sandbox
            if call.get("text") is not None:
                self.env.call(workspace, str(call["text"]), box)
            else:
                self.env.call_args(workspace, str(call["name"]), call.get("args"), box)
        row = _Row.of_state(state, workspace)
        row.timings["tool_s"] += time.perf_counter() - started
        return row

    def _generate(
        self,
        context: torch.Tensor,
        generator: torch.Generator,
        prior: Prior | None,
        max_new: int | None = None,
    ) -> Generation:
        return self.engine.generate(
            context,
            max_new=self.cfg.max_new_tokens if max_new is None else max_new,
            temperature=self.cfg.temperature,
            generator=generator,
            stop_ids=self.fmt.stop_ids(),
            prior=prior,
        )

    def _take(self, row: _Row) -> None:
        """Append the row's pending generation to its turn (``open`` when it was cut)."""
        assert row.pending is not None
        gen, b = row.pending
        row.pending, row.gen = None, (gen, b)
        n = int(gen.lengths[b])
        new = gen.tokens[b, :n].tolist()
        routes = _routes(gen, b, n, gen.prompt_len, self.expert_bytes)
        row.emit(new, gen.logprobs[b, :n].tolist(), routes, _versions(gen, b, n, gen.prompt_len))
        row.turn += new
        row.open = gen.cut is not None and bool(gen.cut[b])

    def _context(self, row: _Row, new: list[int]) -> tuple[torch.Tensor, Prior | None, int]:
        """What to run to continue the row's segment with ``new`` tokens: the context, the
        prior whose cache it continues, and how many leading context tokens are already in the
        row. Without a cache (a restored row) the whole segment is fed again (prefill); with no
        new token the last one is fed again, for the logits of the next."""
        segment = row.tokens[row.seg_start :]
        if row.gen is None:
            return torch.tensor([segment + new]), None, len(segment)
        gen, b = row.gen
        if new:
            return torch.tensor([new]), Prior(gen, b, segment), 0
        return torch.tensor([segment[-1:]]), Prior(gen, b, segment[:-1]), 1

    def _run(
        self,
        row: _Row,
        new: list[int],
        generator: torch.Generator,
        max_new: int | None = None,
        fresh: list[int] | None = None,
    ) -> None:
        """Generate after ``new`` (or, with ``fresh``, from a new segment's prompt) and leave
        the result pending on the row; the tokens fed that the row lacks are appended."""
        if fresh is not None:
            context, prior, skip = torch.tensor([fresh]), None, 0
        else:
            context, prior, skip = self._context(row, new)
        started = time.perf_counter()
        gen = self._generate(context, generator, prior, max_new)
        row.timings["generate_s"] += time.perf_counter() - started
        fed = context.shape[1] - skip
        if fed:
            row.feed(
                context[0, skip:].tolist(),
                _routes(gen, 0, fed, skip, self.expert_bytes),
                _versions(gen, 0, fed, skip),
            )
        if fresh is not None:
            row.seg_prompt = len(row.tokens)
        row.pending = (gen, 0)

    def _stopping(self) -> bool:
        return self.preempt is not None and self.preempt()

    def _finish(self, row: _Row, prompt: str, generator: torch.Generator) -> None:
        """Keep the row going through its turns and tool calls until its answer (or a reclaim:
        ``_Reclaimed``, the row's state kept at a point ``group(resume=...)`` goes on from)."""
        while not row.done:
            if row.pending is not None:
                self._take(row)
            if row.open:  # a turn cut part-way: on within its own budget, unless reclaimed
                if self._stopping():
                    raise _Reclaimed
                row.open = False
                left = self.cfg.max_new_tokens - len(row.turn)
                if left > 0:
                    self._run(row, [], generator, max_new=left)
                continue
            if self._stopping():  # between two turns: the turn's calls run on resume
                raise _Reclaimed
            turn_ids, row.turn = row.turn, []
            turn = self.text.decode(turn_ids)
            row.transcript.append(turn)
            if not self.fmt.wants_tools(turn_ids, turn):
                final = bool(turn_ids) and turn_ids[-1] in self.text.eos_ids
                row.close("final" if final else "truncated")
                return
            obs = self._tool_turn(row, turn)
            used = len(row.tokens) - row.seg_start
            if used + len(obs) + self.cfg.max_new_tokens <= self.window:
                self._run(row, obs, generator)
            elif len(row.segments) + 1 < self.cfg.max_segments:
                written = self._summarise(row, generator)
                row.close("compacted")
                text = _compaction_prompt(prompt, row, self.cfg, written)
                row.gen = None
                self._run(row, [], generator, fresh=self.text.prompt(text, self.tools))
            else:
                row.close("truncated")
                return

    def _summarise(self, row: _Row, generator: torch.Generator) -> str | None:
        """The policy's own summary as the segment's last turn (module rules); None: fixed.
        A reclaim during the summary ends it there (a shorter summary, nothing lost)."""
        request = self.fmt.observation([SUMMARY_REQUEST])
        budget = self.cfg.summary_tokens
        if self.cfg.summary != "policy" or (
            len(row.tokens) - row.seg_start + len(request) + budget > self.window
        ):
            return None
        context, prior, skip = self._context(row, request)
        started = time.perf_counter()
        out = self._generate(context, generator, prior, budget)
        row.timings["generate_s"] += time.perf_counter() - started
        fed = context.shape[1] - skip
        row.feed(
            context[0, skip:].tolist(),
            _routes(out, 0, fed, skip, self.expert_bytes),
            _versions(out, 0, fed, skip),
        )
        n = int(out.lengths[0])
        new = out.tokens[0, :n].tolist()
        routes = _routes(out, 0, n, out.prompt_len, self.expert_bytes)
        row.emit(new, out.logprobs[0, :n].tolist(), routes, _versions(out, 0, n, out.prompt_len))
        row.summaries.append(self.fmt.clean(self.text.decode(new), self.cfg.summary_chars))
        return row.summaries[-1]

    def _tool_turn(self, row: _Row, turn: str) -> list[int]:
        """Run the calls of the turn just generated; the observation tokens to append."""
        if self.fmt.name == "tags":  # the last <run> block since the segment's prompt
            calls = self.fmt.calls(self.text.decode(row.tokens[row.seg_prompt :]))
        else:
            calls = self.fmt.calls(turn)
        outputs = [self._call(row, call) for call in calls]
        row.transcript.append("<out>" + "\n".join(outputs) + "</out>")
        return self.fmt.observation(outputs)

    def _call(self, row: _Row, call: Call) -> str:
        """Run one call (or answer why it cannot run); record it; the output the policy sees."""
        started = time.perf_counter()
        record: dict[str, Any]
        if row.turns >= self.cfg.max_turns:
            output, record = "no tool calls left", {"tool": "", "status": "over_budget"}
        else:
            if call.error is not None:
                name, output, status, mode = call.name or "?", f"[error: {call.error}]", "error", ""
            else:
                box = self.cfg.tool_sandbox
                name, result = (
                    self.env.call(row.workspace, call.text, box)
                    if call.text is not None
                    else self.env.call_args(row.workspace, str(call.name), call.args, box)
                )
                output = self.fmt.clean(result.output, self.cfg.tool_output_chars)
                status, mode = result.status, result.isolation
            record = {"tool": name, "status": status, "isolation": mode or "not_run"}
            if call.error is None:
                row.replay.append({"text": call.text, "name": call.name, "args": call.args})
            row.turns += 1
            row.tool_errors += status != "ok"
        row.outputs.append(output)
        spent = time.perf_counter() - started
        row.timings["tool_s"] += spent
        shown = call.shown if call.error is None else f"[unreadable call: {call.error}]"
        row.calls.append(
            {**record, "input": shown[:200], "output": output, "ms": round(spent * 1000, 1)}
        )
        return output

    def _sample(self, index: int, row: _Row) -> Sample:
        last = row.segments[-1]
        if self.env.final is not None:
            text = self.env.final(row.workspace)
        elif self.fmt.name == "tags":
            text = self.text.decode(row.tokens[row.seg_prompt : last.end])
        else:
            text = "".join(row.transcript)
        return Sample(
            index=index,
            token_ids=np.asarray(row.tokens, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            loss_mask=np.asarray(row.mask, dtype=np.uint8),
            routes=np.concatenate(row.routes, axis=0),
            versions=np.asarray(row.versions, dtype=np.int64),
            segments=row.segments,
            completion=text,
            turns=row.turns,
            finished=last.reason == "final",
            timings=dict(row.timings),
            tool_calls=row.calls,
            tool_errors=row.tool_errors,
            summaries=row.summaries,
        )


def rollout_group(
    model: PolicyModel,
    prompt: str,
    group_size: int,
    cfg: HarnessConfig | None = None,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> list[Sample]:
    """Convenience wrapper: ``Rollout(model, cfg).group(prompt, group_size, generator)``."""
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    return Rollout(model, cfg or HarnessConfig(), **kwargs).group(prompt, group_size, gen)
