"""The policy's text and token ids: its own Hugging Face tokenizer, and the agent protocol's tags.

Every role that turns text into the policy's tokens or back (the rollout harness, the policy
server, the warm start) goes through a ``PolicyText``, built from the policy's own tokenizer:
the tokenizer files of ``policy.hf_dir``, or the demo's character tokenizer
(``char_tokenizer``, whose ids equal ``envs.protocol.encode``). Rules:

- ``prompt(text)``: with a chat template, the template applied to one user message with the
  generation prompt (``apply_chat_template(..., add_generation_prompt=True)``); without one, the
  BOS token (when the tokenizer has one) then ``encode(text)``. ``tools`` (OpenAI function
  schemas) go to the template as ``tools=``: a tool-calling template lists them for the model
  (``rollout.toolcalls``).
- ``after_assistant(outputs)``: the template's text for ``outputs`` as ``tool`` messages after an
  assistant turn, from just after that turn's end-of-turn token through the next assistant
  prompt (what a tool-calling policy sees between two of its turns).
- ``encode`` adds no special token; ``decode`` leaves out PAD, BOS and the end-of-sequence ids
  and every other special token, and keeps the protocol tags.
- The harness's tool protocol (``envs.protocol.TAGS``: ``<run>``, ``</run>``, ``<out>``, ...) needs
  each tag to be one token that is not special: ``with_protocol_tags`` adds the missing ones to
  a tokenizer (as non-special added tokens, so they decode as text); a tokenizer that holds a
  tag as a special token is refused (decoding would drop it).
- ``stop_ids`` ends a turn: the end-of-sequence ids (the tokenizer's EOS and those the model's
  generation config names, e.g. a chat model's end-of-turn token) and ``</run>``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlstream.envs import protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def with_protocol_tags(tokenizer: Any) -> Any:
    """``tokenizer`` (in place) with every protocol tag one non-special token; raises
    ``ValueError`` for a tag it holds as a special token."""
    from tokenizers import AddedToken

    special = set(tokenizer.all_special_tokens)
    clash = [t for t in protocol.TAGS if t in special]
    if clash:
        raise ValueError(f"the tokenizer holds protocol tags as special tokens: {clash}")
    vocab = tokenizer.get_vocab()
    missing = [t for t in protocol.TAGS if t not in vocab]
    if missing:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in missing])
    return tokenizer


class PolicyText:
    """Text <-> token ids of one policy (module rules)."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer = with_protocol_tags(tokenizer)
        ids = self.tokenizer.convert_tokens_to_ids(list(protocol.TAGS))
        self.run, self.run_end, self.out, self.out_end = ids[:4]
        eos = [tokenizer.eos_token_id, *eos_ids]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        if not self.eos_ids:
            raise ValueError("the tokenizer names no end-of-sequence token")
        self.bos: int | None = tokenizer.bos_token_id
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_ids: tuple[int, ...] = (*self.eos_ids, self.run_end)
        self._dropped = {*self.eos_ids, self.pad_id, *([self.bos] if self.bos is not None else [])}
        self._templated = bool(getattr(tokenizer, "chat_template", None))

    def __deepcopy__(self, memo: dict[int, Any]) -> PolicyText:
        return self  # read-only once built: a copied policy shares its text

    @classmethod
    @functools.cache
    def chars(cls) -> PolicyText:
        """The demo's character tokenizer (one per process)."""
        return cls(char_tokenizer())

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        kept = [int(i) for i in ids if int(i) not in self._dropped]
        return str(self.tokenizer.decode(kept, skip_special_tokens=True))

    def prompt(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        if self._templated:
            messages = [{"role": "user", "content": text}]
            extra = {"tools": tools} if tools else {}
            out = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **extra
            )
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(i) for i in ids]
        return [*([self.bos] if self.bos is not None else []), *self.encode(text)]

    def after_assistant(self, outputs: list[str]) -> str:
        """The template's tool messages for ``outputs`` after an assistant turn (module rules);
        ValueError for a template that does not render them after the turn's end token."""
        turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        tools = [{"role": "tool", "content": out} for out in outputs]
        done = str(self.tokenizer.apply_chat_template(turn, tokenize=False))
        more = str(
            self.tokenizer.apply_chat_template(
                turn + tools, tokenize=False, add_generation_prompt=True
            )
        )
        ends = [str(self.tokenizer.convert_ids_to_tokens(i)) for i in self.eos_ids]
        cut = max((done.rfind(e) + len(e) for e in ends if e in done), default=-1)
        if cut < 0 or not more.startswith(done[:cut]):
            raise ValueError("the chat template does not render tool messages after a turn")
        return more[cut:]


_SPECIALS = {"<pad>": protocol.PAD, "<s>": protocol.BOS, "</s>": protocol.EOS}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """The demo's char-level tokenizer as an HF tokenizer: ids equal ``protocol.encode``.

    Rules: each tag is one added (non-special) token; every other character is one token, and a
    character outside printable ASCII and newline is ``?`` (the word-level model's unknown
    token). PAD/BOS/EOS (``<pad>``, ``<s>``, ``</s>``) and fillers up to ``VOCAB_SIZE`` are special
    tokens that text never produces (``split_special_tokens``: ``"<s>"`` in text is three
    characters, as ``encode`` reads it) and that ``decode(..., skip_special_tokens=True)`` drops,
    as ``protocol.decode`` does. No BOS/EOS is added on encoding.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(_SPECIALS)
    vocab.update({tag: protocol.RUN + i for i, tag in enumerate(protocol.TAGS)})
    vocab.update(
        {
            protocol.decode([i]): i
            for i in range(protocol.RUN + len(protocol.TAGS), protocol.VOCAB_SIZE)
        }
    )
    vocab = {k: v for k, v in vocab.items() if k}  # ids past the characters decode to ""
    fillers = [f"<|unused{i}|>" for i in range(len(vocab), protocol.VOCAB_SIZE)]
    vocab.update({f: len(vocab) + i for i, f in enumerate(fillers)})
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise AssertionError("char vocabulary ids are not contiguous")
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in protocol.TAGS])
    specials = [*_SPECIALS, *fillers]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
