"""Tool-call formats: how a policy's turn names its tool calls and how their results come back.

The format is the policy's own, chosen from its tokenizer (``format_for``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes and the other chat templates that define ``<tool_call>``):
  the tools are offered as JSON schemas through the chat template (``tools=`` of
  ``apply_chat_template``); the model ends a turn with its end-of-turn token, and the turn calls
  a tool with ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (several per turn
  allowed, run in order). The results go back as ``tool`` messages rendered by the same chat
  template (``observation``: the template's text after the assistant turn, up to the next
  assistant prompt), so the model sees exactly what it was trained to see.
- ``tags`` (rlstream's own, for the built-in character model and any tokenizer whose template
  defines no tool calls): ``<run>CALL</run>`` ends the turn, ``<out>OUTPUT</out>`` answers it
  (``envs.protocol``, ``envs.tools``: ``@NAME INPUT`` picks the tool).

Rules: a turn that names a tool call which does not parse (not JSON, no ``name``, arguments
not an object, a ``<tool_call>`` never closed) is answered with a tool error saying what is
wrong, which the model sees; the rollout goes on. Tool output never forges the format: every
special or added token's text and every format tag in it is defused (``<`` -> ``[``, ``>`` ->
``]``) before it is tokenized, and it is cut to the harness's ``tool_output_chars``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlstream.envs import protocol
from rlstream.rollout.text import PolicyText

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class Call:
    """One tool call of a turn: the tool's name and arguments (JSON formats) or its text input
    (``tags``), or why it could not be read (``error``)."""

    name: str | None = None
    args: Any = None
    text: str | None = None
    error: str | None = None

    @property
    def shown(self) -> str:
        """The call as the trajectory records it."""
        if self.text is not None:
            return self.text
        return json.dumps({"name": self.name, "arguments": self.args}) if not self.error else ""


def defuse(text: str, tokens: list[str]) -> str:
    """``text`` with each of ``tokens`` spelled with brackets, so it tokenizes as plain text."""
    for tok in sorted(tokens, key=len, reverse=True):
        if tok and tok in text:
            text = text.replace(tok, tok.replace("<", "[").replace(">", "]"))
    return text


class TagFormat:
    """rlstream's ``<run>``/``<out>`` tags (see the module rules)."""

    name = "tags"
    offers_schemas = False

    def __init__(self, text: PolicyText) -> None:
        self.text = text

    def stop_ids(self) -> tuple[int, ...]:
        return self.text.stop_ids

    def wants_tools(self, new: list[int], turn: str) -> bool:
        return bool(new) and new[-1] == self.text.run_end

    def calls(self, turn: str) -> list[Call]:
        return [Call(text=turn.rsplit("<run>", 1)[-1].removesuffix("</run>"))]

    def clean(self, output: str, cap: int) -> str:
        return defuse(output, list(protocol.TAGS))[:cap]

    def observation(self, outputs: list[str]) -> list[int]:
        ids: list[int] = []
        for out in outputs:
            ids += [self.text.out, *self.text.encode(out), self.text.out_end]
        return ids


class HermesFormat:
    """``<tool_call>`` JSON in the turn, results as ``tool`` messages (see the module rules)."""

    name = "hermes"
    offers_schemas = True

    def __init__(self, text: PolicyText) -> None:
        self.text = text
        tok = text.tokenizer
        self.reserved = [
            *tok.all_special_tokens,
            *tok.get_added_vocab(),
            HERMES_OPEN,
            HERMES_CLOSE,
            "<tool_response>",
            "</tool_response>",
        ]

    def stop_ids(self) -> tuple[int, ...]:
        return self.text.eos_ids

    def wants_tools(self, new: list[int], turn: str) -> bool:
        return bool(new) and new[-1] in self.text.eos_ids and HERMES_OPEN in turn

    def calls(self, turn: str) -> list[Call]:
        return [parse_hermes(body) for body in _CALL.findall(turn)]

    def clean(self, output: str, cap: int) -> str:
        return defuse(output, self.reserved)[:cap]

    def observation(self, outputs: list[str]) -> list[int]:
        """The template's rendering of ``outputs`` as tool messages after an assistant turn,
        through the next assistant prompt (the turn's own end token excluded: it was generated)."""
        return self.text.encode(self.text.after_assistant(outputs))


def parse_hermes(body: str) -> Call:
    """One ``<tool_call>`` body as a ``Call``; ``error`` says what is wrong with it."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return Call(error=f"tool call is not JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return Call(error='tool call must be {"name": TOOL, "arguments": {...}}')
    args = value.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Call(name=value["name"], error="tool call arguments are not a JSON object")
    if not isinstance(args, dict):
        return Call(name=value["name"], error="tool call arguments are not a JSON object")
    return Call(name=value["name"], args=args)


ToolFormat = TagFormat | HermesFormat


def format_for(text: PolicyText) -> ToolFormat:
    """The policy's own format: ``hermes`` when its chat template defines ``<tool_call>``."""
    template = getattr(text.tokenizer, "chat_template", None) or ""
    return HermesFormat(text) if HERMES_OPEN in str(template) else TagFormat(text)
