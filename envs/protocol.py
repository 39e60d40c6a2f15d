"""The agent protocol and the character vocabulary, shared by every role that speaks to the policy.

The protocol: a policy calls a tool by writing ``<run>CODE</run>``; the harness answers with
``<out>OUTPUT</out>`` and, when it compacts a long history, ``<sum>SUMMARY</sum>``
(``rollout.harness``). The answer of a completion is what follows the last tool output, first
line only (``final_answer``). Each tag is one token for every policy (``rollout.text`` adds the
tags a tokenizer lacks), so a tool call costs one token per tag.

The character vocabulary is the demo policy's tokenizer: ids 0-2 are PAD, BOS and EOS, then one
id per tag (``RUN`` ... ``SUM_END``), then one per character of printable ASCII and newline;
``VOCAB_SIZE`` rounds that up. ``encode`` and ``decode`` are its rules (``rollout.text`` builds
the same vocabulary as a Hugging Face tokenizer). No task family owns either: ``fx``, ``dataset``
and any plugin use them as they are.
"""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
TAGS = ("<run>", "</run>", "<out>", "</out>", "<sum>", "</sum>")
RUN, RUN_END, OUT, OUT_END, SUM, SUM_END = range(3, 3 + len(TAGS))
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
_FIRST_CHAR = 3 + len(TAGS)
VOCAB_SIZE = 128  # 105 used; rounded up
_CHAR_ID = {c: _FIRST_CHAR + i for i, c in enumerate(_CHARS)}
_UNKNOWN = _CHAR_ID["?"]


def encode(text: str) -> list[int]:
    """Token ids of ``text``: tags become one token each, other characters one token each.

    Rule: characters outside printable ASCII and newline map to ``?``; no BOS/EOS is added.
    """
    ids: list[int] = []
    i = 0
    while i < len(text):
        if text[i] == "<":
            tag = next((t for t in TAGS if text.startswith(t, i)), None)
            if tag is not None:
                ids.append(3 + TAGS.index(tag))
                i += len(tag)
                continue
        ids.append(_CHAR_ID.get(text[i], _UNKNOWN))
        i += 1
    return ids


def decode(ids: list[int]) -> str:
    """Text of ``ids``; PAD, BOS and EOS decode to nothing."""
    out = []
    for t in ids:
        if t >= _FIRST_CHAR and t - _FIRST_CHAR < len(_CHARS):
            out.append(_CHARS[t - _FIRST_CHAR])
        elif 3 <= t < _FIRST_CHAR:
            out.append(TAGS[t - 3])
    return "".join(out)


def final_answer(text: str) -> str:
    """The answer part of a completion: what follows the last tool output, first line only."""
    for tag in ("</out>", "</sum>"):
        if tag in text:
            text = text.rsplit(tag, 1)[1]
    return text.strip().split("\n", 1)[0].strip()
