"""Writes ``pyfuncs.jsonl``: small Python function problems for the ``dataset`` task family.

``python -m rlstream.envs.pyfuncs_build [OUT]`` (standard library only, no network; OUT defaults
to ``envs/data/pyfuncs.jsonl``). Each TEMPLATE is a kind of function with five variants
(constants, names, small changes of rule); each variant is one problem ``pyfuncs/TEMPLATE/I``.

Rules a maintainer must keep:
- deterministic: every random choice comes from ``random.Random("TEMPLATE/I")`` and the rows
  are written in a fixed order, so a rerun rewrites the file byte for byte (a test checks it);
- the split is by template: all variants of a template carry its ``split``, so no held-out
  problem shares a template with a training one;
- no expected value is typed by hand: every test value and docstring example comes from
  running the reference body (``canonical_solution``) here, and a problem is refused unless the
  reference passes its own test, ``return None`` fails it, and its tests see two or more
  different answers (so no constant answer passes);
- rows go variant by variant across templates, so the first held-out rows in file order
  (``eval_tasks(n)``) cover every held-out template before repeating one.

Details: docs/task-families.md (The pyfuncs set).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import random
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Args = tuple[Any, ...]
Split = Literal["train", "eval"]
PER_TEMPLATE = 5
OUT = Path(__file__).resolve().parent / "data" / "pyfuncs.jsonl"
WORDS = (
    "apple", "banana", "cherry", "delta", "echo", "falcon", "grape", "harbor", "igloo", "jungle",
    "kiwi", "lemon", "mango", "night", "ocean", "pepper", "quartz", "river", "stone", "tiger",
    "violet", "walnut", "yellow", "zebra", "a", "an", "at", "be", "go", "sky", "tree", "owl",
    "sea", "sun", "moon", "star", "cat", "dog", "idea", "oak",
)  # fmt: skip


@dataclass(frozen=True)
class Fn:
    """One problem: signature, docstring text, reference body, test inputs, shown examples."""

    name: str
    params: str
    doc: str
    body: str
    cases: list[Args]
    examples: list[Args]


Maker = Callable[[random.Random, int], Fn]


@dataclass(frozen=True)
class Template:
    name: str
    split: Split
    make: Maker


TEMPLATES: list[Template] = []


def template(name: str, split: Split = "train") -> Callable[[Maker], Maker]:
    """Register a maker of variant ``i`` (0 to PER_TEMPLATE - 1) as template ``name``."""

    def register(make: Maker) -> Maker:
        TEMPLATES.append(Template(name, split, make))
        return make

    return register


# ---------------------------------------------------------------- random inputs


def one(*values: Any) -> list[Args]:
    """Test inputs of a one-parameter function."""
    return [(v,) for v in values]


def words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def sentence(rng: random.Random, lo: int = 2, hi: int = 6) -> str:
    return " ".join(words(rng, rng.randint(lo, hi)))


def ints(rng: random.Random, n: int, lo: int = -9, hi: int = 9) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def chars(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def mixed(rng: random.Random, n: int) -> str:
    return chars(rng, "abcdeiouXYZ 0123.,!?", n)


def runs(rng: random.Random, alphabet: str = "abc", most: int = 4) -> str:
    return "".join(rng.choice(alphabet) * rng.randint(1, most) for _ in range(rng.randint(2, 5)))


def small_dict(rng: random.Random, n: int, hi: int = 3) -> dict[str, int]:
    return {k: rng.randint(0, hi) for k in rng.sample("abcdefgh", n)}


def counted(n: int, noun: str) -> str:
    """``1 place``, ``3 places``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def tag(n: int) -> str:
    """A number as part of a function name."""
    return f"minus_{-n}" if n < 0 else str(n)


ORDINAL = {2: "second", 3: "third", 4: "fourth", 5: "fifth", 6: "sixth"}

# ---------------------------------------------------------------- strings


@template("count_class")
def _count_class(rng: random.Random, i: int) -> Fn:
    label, what, cond = [
        ("vowels", "the vowels (a, e, i, o, u, in either case)", "ch.lower() in 'aeiou'"),
        ("digits", "the digits 0 to 9", "ch.isdigit()"),
        ("uppercase", "the upper-case letters", "ch.isupper()"),
        ("spaces", "the space characters", "ch == ' '"),
        ("consonants", "the consonants (letters other than a, e, i, o, u, in either case)",
         "ch.isalpha() and ch.lower() not in 'aeiou'"),
    ][i]  # fmt: skip
    return Fn(
        f"count_{label}", "text", f"Count {what} in text.",
        f"return sum(1 for ch in text if {cond})",
        one("", "Hello World 42", "AEIOU xyz", mixed(rng, 12), mixed(rng, 20)), [("Hi There 7",)],
    )  # fmt: skip


@template("reverse_fields")
def _reverse_fields(rng: random.Random, i: int) -> Fn:
    sep, label = [(" ", "words"), (",", "comma_fields"), ("-", "hyphen_parts"),
                  ("/", "path_parts"), ("_", "underscore_parts")][i]  # fmt: skip
    what = "single spaces" if sep == " " else f"single {sep!r} characters"
    return Fn(
        f"reverse_{label}", "text",
        f"text is made of parts separated by {what}. Return the parts in reverse order, "
        "joined the same way.",
        f"return {sep!r}.join(text.split({sep!r})[::-1])",
        one("", "one", sep.join(words(rng, 2)), sep.join(words(rng, 4)), sep.join(words(rng, 5)),
            f"a{sep}{sep}b"),
        [(sep.join(["red", "green", "blue"]),)],
    )  # fmt: skip


@template("capitalise_long")
def _capitalise_long(rng: random.Random, i: int) -> Fn:
    k = [2, 3, 4, 5, 6][i]
    return Fn(
        f"capitalise_words_longer_than_{k}", "text",
        f"Return text with the first letter of every word longer than {k} letters made upper "
        "case; words are separated by single spaces and every other letter stays as it is.",
        f"return ' '.join(w[:1].upper() + w[1:] if len(w) > {k} else w for w in text.split(' '))",
        one("", "a", "b" * k + " " + "c" * (k + 1), sentence(rng, 4, 7), sentence(rng, 4, 7),
            sentence(rng, 2, 3)),
        [("the quick brown fox jumps",)],
    )  # fmt: skip


@template("strip_prefix")
def _strip_prefix(rng: random.Random, i: int) -> Fn:
    p = ["re", "un", "pre", "dis", "over"][i]
    return Fn(
        f"strip_prefix_{p}", "word",
        f"If word starts with {p!r}, return it without that prefix (removed once); otherwise "
        "return word unchanged.",
        f"return word[{len(p)}:] if word.startswith({p!r}) else word",
        one("", p, p + "do", p + p + "x", "x" + p, rng.choice(WORDS), p.upper() + "do"),
        [(p + "build",)],
    )  # fmt: skip


@template("strip_suffix")
def _strip_suffix(rng: random.Random, i: int) -> Fn:
    s = ["ing", "ed", "ly", "ness", "ful"][i]
    return Fn(
        f"strip_suffix_{s}", "word",
        f"If word ends with {s!r}, return it without that suffix (removed once); otherwise "
        "return word unchanged.",
        f"return word[:-{len(s)}] if word.endswith({s!r}) else word",
        one("", s, "jump" + s, "x" + s + s, s + "x", rng.choice(WORDS), "jump" + s.upper()),
        [("play" + s,)],
    )  # fmt: skip


@template("run_length")
def _run_length(rng: random.Random, i: int) -> Fn:
    group = "from itertools import groupby\n"
    name, doc, body = [
        ("rle_char_count",
         "Run-length encode text: each run of equal characters becomes the character "
         "followed by the length of the run.",
         group + "return ''.join(ch + str(len(list(run))) for ch, run in groupby(text))"),
        ("rle_count_char",
         "Run-length encode text: each run of equal characters becomes the length of the "
         "run followed by the character.",
         group + "return ''.join(str(len(list(run))) + ch for ch, run in groupby(text))"),
        ("rle_compact",
         "Run-length encode text: each run of equal characters becomes the character "
         "followed by the length of the run, the length left out when it is 1.",
         group + "out = ''\nfor ch, run in groupby(text):\n    n = len(list(run))\n"
         "    out += ch + (str(n) if n > 1 else '')\nreturn out"),
        ("rle_decode",
         "text is a run-length code: pairs of a character and a one-digit count (1 to 9). "
         "Return the decoded string, each character repeated count times.",
         "return ''.join(text[k] * int(text[k + 1]) for k in range(0, len(text), 2))"),
        ("run_lengths",
         "The list of (character, length) tuples of the runs of equal characters in text, "
         "in order.",
         group + "return [(ch, len(list(run))) for ch, run in groupby(text)]"),
    ][i]  # fmt: skip
    if name == "rle_decode":
        codes = ["".join(rng.choice("abxyz") + str(rng.randint(1, 9)) for _ in range(n))
                 for n in (2, 3, 4)]  # fmt: skip
        return Fn(name, "text", doc, body, one("", "a1", "z9", *codes), [("a3b1c2",)])
    cases = one("", "a", "abc", "aaab", runs(rng), runs(rng), runs(rng, "xy", 6))
    return Fn(name, "text", doc, body, cases, [("aaabccdddd",)])


@template("caesar")
def _caesar(rng: random.Random, i: int) -> Fn:
    k = [1, 3, 5, 13, 25][i]
    return Fn(
        f"caesar_shift_{k}", "text",
        f"Shift every lower-case letter of text {counted(k, 'place')} forward in the "
        "alphabet, wrapping around from 'z' to 'a'; every other character is unchanged.",
        f"return ''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch "
        "for ch in text)",
        one("", "abc", "xyz", "Hello, World!", sentence(rng), sentence(rng)),
        [("attack at dawn",)],
    )  # fmt: skip


@template("replace_vowels")
def _replace_vowels(rng: random.Random, i: int) -> Fn:
    c, label = [("*", "stars"), ("_", "underscores"), ("#", "hashes"), ("?", "question_marks"),
                ("-", "dashes")][i]  # fmt: skip
    return Fn(
        f"vowels_to_{label}", "text",
        f"Return text with every vowel (a, e, i, o, u, in either case) replaced by {c!r}.",
        f"return ''.join({c!r} if ch.lower() in 'aeiou' else ch for ch in text)",
        one("", "xyz", "AEIOU", "Hello World", mixed(rng, 15), sentence(rng)),
        [("Programming is fun",)],
    )  # fmt: skip


@template("remove_chars")
def _remove_chars(rng: random.Random, i: int) -> Fn:
    label, gone, what = [
        ("digits", "0123456789", "every digit"),
        ("punctuation", ".,;:!?", "every one of the characters . , ; : ! ?"),
        ("spaces", " ", "every space"),
        ("brackets", "()[]{}", "every bracket ( ) [ ] { }"),
        ("dashes", "-_", "every '-' and '_'"),
    ][i]  # fmt: skip
    alphabet = "ab 1.(-_)!9;"
    return Fn(
        f"remove_{label}", "text", f"Return text with {what} removed.",
        f"return ''.join(ch for ch in text if ch not in {gone!r})",
        one("", "abc", "a1 b2.(c)-d_e!", chars(rng, alphabet, 12), chars(rng, alphabet, 18)),
        [("Hi, (it's) 10-4_ok!",)],
    )  # fmt: skip


@template("palindromes")
def _palindromes(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("is_palindrome_exact",
         "True if text reads the same forwards and backwards, character for character "
         "(case matters).", "return text == text[::-1]"),
        ("is_palindrome_nocase",
         "True if text reads the same forwards and backwards, ignoring upper and lower case.",
         "t = text.lower()\nreturn t == t[::-1]"),
        ("is_palindrome_nospaces",
         "True if text reads the same backwards once its spaces are removed, ignoring case.",
         "t = text.replace(' ', '').lower()\nreturn t == t[::-1]"),
        ("is_palindrome_letters",
         "True if the letters of text, ignoring case and every other character, read the same "
         "backwards.", "t = [ch.lower() for ch in text if ch.isalpha()]\nreturn t == t[::-1]"),
        ("is_word_palindrome",
         "True if the words of text (split on whitespace) read the same in reverse order.",
         "w = text.split()\nreturn w == w[::-1]"),
    ][i]  # fmt: skip
    cases = one("", "abba", "Abba", "abca", "Never odd or even", "Step on no pets!",
                "dog cat dog", "go dog")  # fmt: skip
    return Fn(name, "text", doc, body, cases, [("racecar",), ("Racecar",)])


@template("word_extremes")
def _word_extremes(rng: random.Random, i: int) -> Fn:
    head = "words = text.split()\n"
    name, doc, body = [
        ("longest_word", "The longest word of text (words are split on whitespace), the first "
         "one on a tie; '' if there are none.",
         head + "return max(words, key=len) if words else ''"),
        ("shortest_word", "The shortest word of text (words are split on whitespace), the first "
         "one on a tie; '' if there are none.",
         head + "return min(words, key=len) if words else ''"),
        ("last_longest_word", "The longest word of text (words are split on whitespace), the last "
         "one on a tie; '' if there are none.",
         "best = ''\nfor w in text.split():\n    if len(w) >= len(best):\n        best = w\n"
         "return best"),
        ("most_vowels_word", "The word of text (split on whitespace) with the most vowels (a, e, "
         "i, o, u, in either case), the first one on a tie; '' if there are no words.",
         head + "if not words:\n    return ''\n"
         "return max(words, key=lambda w: sum(ch in 'aeiou' for ch in w.lower()))"),
        ("first_word_alphabetically", "The word of text (split on whitespace) that is smallest "
         "in plain string order (upper-case letters sort before lower-case); '' if there are "
         "none.", head + "return min(words) if words else ''"),
    ][i]  # fmt: skip
    cases = one("", "one", "aa bb", sentence(rng, 3, 7), sentence(rng, 3, 7), "Zebra apple Mango")
    return Fn(name, "text", doc, body, cases, [("the owl saw a squirrel eat acorns",)])


@template("count_long_words")
def _count_long_words(rng: random.Random, i: int) -> Fn:
    k = [3, 4, 5, 6, 7][i]
    return Fn(
        f"count_words_of_at_least_{k}", "text",
        f"Count the words of text (split on whitespace) that have at least {k} characters.",
        f"return sum(1 for w in text.split() if len(w) >= {k})",
        one("", "a" * k, "b" * (k - 1), sentence(rng, 4, 8), sentence(rng, 4, 8),
            sentence(rng, 4, 8)),
        [("the seven tigers crossed a wide river",)],
    )  # fmt: skip


@template("acronym", "eval")
def _acronym(rng: random.Random, i: int) -> Fn:
    k = [1, 2, 3, 4, 5][i]
    return Fn(
        f"acronym_of_words_from_{k}", "text",
        f"The first letters, upper-cased and joined together, of the words of text (split on "
        f"whitespace) that have at least {counted(k, 'letter')}.",
        f"return ''.join(w[0].upper() for w in text.split() if len(w) >= {k})",
        one("", "a", "portable network graphics", sentence(rng, 3, 7), sentence(rng, 3, 7),
            "as soon as possible"),
        [("the united states of america",)],
    )  # fmt: skip


@template("most_common")
def _most_common(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("most_common_letter", "The letter of text that occurs most often, counting upper and "
         "lower case together and returning it lower-cased; the alphabetically first one on a "
         "tie, '' if text has no letters.",
         "letters = [ch for ch in text.lower() if ch.isalpha()]\nif not letters:\n"
         "    return ''\nreturn min(set(letters), key=lambda ch: (-letters.count(ch), ch))"),
        ("most_common_char", "The character of text that occurs most often, the one that "
         "appears first in text on a tie; '' for an empty text.",
         "return max(text, key=text.count) if text else ''"),
        ("least_common_char", "The character of text that occurs least often, the one that "
         "appears first in text on a tie; '' for an empty text.",
         "return min(text, key=text.count) if text else ''"),
        ("most_common_word", "The word of text (split on whitespace) that occurs most often, "
         "the one that appears first on a tie; '' if there are no words.",
         "words = text.split()\nreturn max(words, key=words.count) if words else ''"),
        ("most_common_vowel", "The vowel (a, e, i, o, u; upper case counts as lower case) that "
         "occurs most often in text, the alphabetically first one on a tie; '' if there is none.",
         "vowels = [ch for ch in text.lower() if ch in 'aeiou']\nif not vowels:\n"
         "    return ''\nreturn min(set(vowels), key=lambda ch: (-vowels.count(ch), ch))"),
    ][i]  # fmt: skip
    cases = one("", "abracadabra", "Hello World", "x x y y", mixed(rng, 14), sentence(rng, 4, 8))
    return Fn(name, "text", doc, body, cases, [("the cat sat on the mat",)])


@template("upper_positions")
def _upper_positions(rng: random.Random, i: int) -> Fn:
    k, r = [(2, 0), (2, 1), (3, 0), (3, 2), (4, 1)][i]
    return Fn(
        f"upper_every_{k}_from_{r}", "text",
        f"Return text in lower case, except the characters at indexes {r}, {r + k}, "
        f"{r + 2 * k}, ... (every {k} characters from index {r}), which are upper case.",
        f"return ''.join(ch.upper() if n % {k} == {r} else ch.lower() "
        "for n, ch in enumerate(text))",
        one("", "a", "ab", "HELLO", sentence(rng), mixed(rng, 10)),
        [("abcdefghij",)],
    )  # fmt: skip


@template("repeat_chars")
def _repeat_chars(rng: random.Random, i: int) -> Fn:
    k = [2, 3, 4, 5, 6][i]
    return Fn(
        f"repeat_each_char_{k}", "text",
        f"Return text with every character repeated {k} times in place.",
        f"return ''.join(ch * {k} for ch in text)",
        one("", "a", "ab", "a b", rng.choice(WORDS)), [("hey!",)],
    )  # fmt: skip


@template("anagrams")
def _anagrams(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("is_anagram_exact", "True if b is a rearrangement of exactly the characters of a "
         "(case and spaces matter).", "return sorted(a) == sorted(b)"),
        ("is_anagram_nocase", "True if b is a rearrangement of the characters of a, ignoring "
         "upper and lower case.", "return sorted(a.lower()) == sorted(b.lower())"),
        ("is_anagram_phrase", "True if a and b use the same letters the same number of times, "
         "ignoring case and spaces.",
         "return sorted(a.lower().replace(' ', '')) == sorted(b.lower().replace(' ', ''))"),
        ("can_spell_from", "True if b can be spelt with the characters of a, each character of "
         "a used at most once (case matters).",
         "from collections import Counter\nreturn not Counter(b) - Counter(a)"),
        ("same_character_set", "True if a and b contain the same set of distinct characters "
         "(how often each occurs does not matter).", "return set(a) == set(b)"),
    ][i]  # fmt: skip
    cases = [("", ""), ("listen", "silent"), ("Listen", "Silent"), ("dormitory", "dirty room"),
             ("abc", "abd"), ("aab", "ab"), ("ab", "aab")]  # fmt: skip
    return Fn(name, "a, b", doc, body, cases, [("night", "thing")])


@template("count_pattern")
def _count_pattern(rng: random.Random, i: int) -> Fn:
    pat, overlap = [("ab", False), ("aa", True), ("the", False), ("ana", True), ("xx", False)][i]
    name = f"count_{pat}_overlapping" if overlap else f"count_{pat}"
    if overlap:
        doc = f"Count the occurrences of {pat!r} in text, overlapping occurrences included."
        body = f"return sum(1 for k in range(len(text)) if text.startswith({pat!r}, k))"
    else:
        doc = (
            f"Count the non-overlapping occurrences of {pat!r} in text, scanning from left to "
            "right (case matters)."
        )
        body = f"return text.count({pat!r})"
    letters = "".join(sorted(set(pat))) + "x"
    cases = one("", pat, pat * 3, pat[:-1], "The the " + pat, chars(rng, letters, 16),
                chars(rng, letters, 20))  # fmt: skip
    return Fn(name, "text", doc, body, cases, [(pat * 2 + "x" + pat,)])


@template("mask_tail", "eval")
def _mask_tail(rng: random.Random, i: int) -> Fn:
    k, c = [(4, "#"), (2, "*"), (3, "x"), (1, "#"), (5, "*")][i]
    return Fn(
        f"mask_all_but_last_{k}", "text",
        f"Replace every character of text except the last {k} with {c!r}; a text of at most "
        f"{k} characters comes back unchanged.",
        f"return {c!r} * max(len(text) - {k}, 0) + text[-{k}:]",
        one("", "a", "z" * k, chars(rng, "0123456789", 16), rng.choice(WORDS) + "s", "ab cd"),
        [("4111222233334444",)],
    )  # fmt: skip


@template("case_convert", "eval")
def _case_convert(rng: random.Random, i: int) -> Fn:
    name, doc, body, join = [
        ("snake_to_camel", "Turn a snake_case name (lower-case words joined by '_') into "
         "camelCase: the first word as it is, every later word capitalised, no separators.",
         "parts = name.split('_')\nreturn parts[0] + ''.join(p.capitalize() for p in parts[1:])",
         "_"),
        ("snake_to_pascal", "Turn a snake_case name (lower-case words joined by '_') into "
         "PascalCase: every word capitalised, no separators.",
         "return ''.join(p.capitalize() for p in name.split('_'))", "_"),
        ("camel_to_snake", "Turn a camelCase name (starting with a lower-case letter) into "
         "snake_case: every upper-case letter becomes '_' followed by its lower-case form.",
         "return ''.join('_' + ch.lower() if ch.isupper() else ch for ch in name)", "camel"),
        ("kebab_to_snake", "Turn a kebab-case name (words joined by '-') into snake_case "
         "(the same words joined by '_').", "return name.replace('-', '_')", "-"),
        ("snake_to_title", "Turn a snake_case name (lower-case words joined by '_') into its "
         "words separated by single spaces, each capitalised.",
         "return ' '.join(p.capitalize() for p in name.split('_'))", "_"),
    ][i]  # fmt: skip

    def spell(parts: list[str]) -> str:
        if join == "camel":
            return parts[0] + "".join(p.capitalize() for p in parts[1:])
        return join.join(parts)

    cases = one("", "word", *(spell(words(rng, n)) for n in (2, 3, 4)))
    return Fn(name, "name", doc, body, cases, [(spell(["max", "line", "length"]),)])


@template("pad_left")
def _pad_left(rng: random.Random, i: int) -> Fn:
    w, c = [(5, "0"), (8, "."), (3, "*"), (6, "-"), (4, "0")][i]
    return Fn(
        f"pad_left_{w}", "text",
        f"Pad text on the left with {c!r} characters to a length of at least {w}; a longer "
        "text comes back unchanged.",
        f"return text.rjust({w}, {c!r})",
        one("", "7", "x" * w, "y" * (w + 2), rng.choice(WORDS)), [("42",)],
    )  # fmt: skip


@template("first_repeat")
def _first_repeat(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("first_repeated_char", "Scanning text from the left, the first character that has "
         "already appeared before it; '' if no character repeats.",
         "seen = set()\nfor ch in text:\n    if ch in seen:\n        return ch\n"
         "    seen.add(ch)\nreturn ''"),
        ("first_unique_char", "The first character of text that occurs exactly once in it; "
         "'' if there is none.",
         "for ch in text:\n    if text.count(ch) == 1:\n        return ch\nreturn ''"),
        ("first_repeated_word", "Scanning the words of text (split on whitespace) from the "
         "left, the first word that has already appeared before it; '' if none repeats.",
         "seen = set()\nfor w in text.split():\n    if w in seen:\n        return w\n"
         "    seen.add(w)\nreturn ''"),
        ("first_unique_word", "The first word of text (split on whitespace) that occurs exactly "
         "once; '' if there is none.",
         "words = text.split()\nfor w in words:\n    if words.count(w) == 1:\n        return w\n"
         "return ''"),
        ("last_unique_char", "The last character of text that occurs exactly once in it; '' "
         "if there is none.",
         "for ch in reversed(text):\n    if text.count(ch) == 1:\n        return ch\nreturn ''"),
    ][i]  # fmt: skip
    cases = one("", "abc", "abca", "aabb", "swiss", "the cat and the hat", "a b a c b",
                sentence(rng, 5, 8))  # fmt: skip
    return Fn(name, "text", doc, body, cases, [("programming",)])


@template("words_with_length")
def _words_with_length(rng: random.Random, i: int) -> Fn:
    k = [2, 3, 4, 5, 6][i]
    return Fn(
        f"words_with_{k}_letters", "text",
        f"The words of text (split on whitespace) that have exactly {k} characters, in order.",
        f"return [w for w in text.split() if len(w) == {k}]",
        one("", "q" * k, "z" * (k + 1), sentence(rng, 4, 9), sentence(rng, 4, 9),
            sentence(rng, 4, 9)),
        [("go see the big brown tiger and a large zebra",)],
    )  # fmt: skip


@template("interleave_strings", "eval")
def _interleave_strings(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("interleave_chars", "Alternate the characters of a and b, starting with a; when one "
         "runs out, append the rest of the other.",
         "n = min(len(a), len(b))\nreturn ''.join(x + y for x, y in zip(a, b)) + a[n:] + b[n:]"),
        ("interleave_chars_b_first", "Alternate the characters of b and a, starting with b; "
         "when one runs out, append the rest of the other.",
         "n = min(len(a), len(b))\nreturn ''.join(y + x for x, y in zip(a, b)) + b[n:] + a[n:]"),
        ("interleave_words", "Alternate the words of a and b (split on whitespace), starting "
         "with a and appending the rest of the longer one; join them with single spaces.",
         "wa, wb = a.split(), b.split()\nout = []\nfor k in range(max(len(wa), len(wb))):\n"
         "    out += wa[k:k + 1] + wb[k:k + 1]\nreturn ' '.join(out)"),
        ("zip_chars_shortest", "Alternate the characters of a and b, starting with a and "
         "stopping when the shorter one runs out.",
         "return ''.join(x + y for x, y in zip(a, b))"),
        ("weave_with_reversed", "Alternate the characters of a and of b reversed, starting with "
         "a; when one runs out, append the rest of the other.",
         "r = b[::-1]\nn = min(len(a), len(r))\n"
         "return ''.join(x + y for x, y in zip(a, r)) + a[n:] + r[n:]"),
    ][i]  # fmt: skip
    cases = [("", ""), ("abc", ""), ("", "xy"), ("abc", "xyz"), ("ab", "wxyz"),
             (sentence(rng, 2, 3), sentence(rng, 1, 4)),
             (rng.choice(WORDS), rng.choice(WORDS))]  # fmt: skip
    return Fn(name, "a, b", doc, body, cases, [("one two three", "four five")])


@template("count_distinct")
def _count_distinct(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("count_distinct_chars", "How many different characters text contains.",
         "return len(set(text))"),
        ("count_distinct_letters", "How many different letters text contains, upper and lower "
         "case counted as the same letter.",
         "return len({ch.lower() for ch in text if ch.isalpha()})"),
        ("count_distinct_words", "How many different words text contains (split on whitespace; "
         "case matters).", "return len(set(text.split()))"),
        ("count_distinct_words_nocase", "How many different words text contains (split on "
         "whitespace), ignoring upper and lower case.", "return len(set(text.lower().split()))"),
        ("count_distinct_digits", "How many different digits 0 to 9 occur in text.",
         "return len({ch for ch in text if ch.isdigit()})"),
    ][i]  # fmt: skip
    cases = one("", "aaa", "The the THE", "abc 112 cab", mixed(rng, 16), sentence(rng, 4, 8))
    return Fn(name, "text", doc, body, cases, [("Go go, 2 dogs, 22 Dogs",)])


@template("truncate")
def _truncate(rng: random.Random, i: int) -> Fn:
    n, s = [(5, "..."), (10, "..."), (8, "~"), (3, ".."), (12, "!")][i]
    return Fn(
        f"truncate_to_{n}", "text",
        f"If text is longer than {n} characters, return its first {n} characters followed by "
        f"{s!r}; otherwise return text unchanged.",
        f"return text[:{n}] + {s!r} if len(text) > {n} else text",
        one("", "x" * n, "y" * (n + 1), sentence(rng, 5, 8), "ok"), [("a rather long sentence",)],
    )  # fmt: skip


# ---------------------------------------------------------------- lists


@template("sum_filtered")
def _sum_filtered(rng: random.Random, i: int) -> Fn:
    name, what, cond = [
        ("sum_evens", "the even numbers", "n % 2 == 0"),
        ("sum_odds", "the odd numbers", "n % 2 != 0"),
        ("sum_positives", "the positive numbers", "n > 0"),
        ("sum_negatives", "the negative numbers", "n < 0"),
        ("sum_multiples_of_3_in", "the multiples of 3", "n % 3 == 0"),
    ][i]  # fmt: skip
    return Fn(
        name, "nums", f"The sum of {what} in nums (0 if there are none).",
        f"return sum(n for n in nums if {cond})",
        one([], [0], [1, 2, 3, 4], [-3, -2, 5], ints(rng, 6), ints(rng, 9)),
        [([1, 2, 3, 6, -4, -3, 9],)],
    )  # fmt: skip


@template("every_kth_max")
def _every_kth_max(rng: random.Random, i: int) -> Fn:
    k, s = [(2, 0), (2, 1), (3, 0), (3, 1), (4, 2)][i]
    return Fn(
        f"max_every_{k}_from_{s}", "nums",
        f"The largest of nums[{s}], nums[{s + k}], nums[{s + 2 * k}], ... (every "
        f"{ORDINAL[k]} element from index {s}); None if there are none.",
        f"picked = nums[{s}::{k}]\nreturn max(picked) if picked else None",
        one([], [5], [1, 2], [7, -1, 3], ints(rng, 5), ints(rng, 8), ints(rng, 11)),
        [([3, 9, 4, 1, 8, 2, 6, 7],)],
    )  # fmt: skip


@template("pairwise")
def _pairwise(rng: random.Random, i: int) -> Fn:
    name, what, expr = [
        ("pairwise_differences", "nums[i + 1] - nums[i]", "b - a"),
        ("pairwise_distances", "abs(nums[i + 1] - nums[i])", "abs(b - a)"),
        ("pairwise_drops", "nums[i] - nums[i + 1]", "a - b"),
        ("pairwise_sums", "nums[i] + nums[i + 1]", "a + b"),
        ("pairwise_maxima", "the larger of nums[i] and nums[i + 1]", "max(a, b)"),
    ][i]  # fmt: skip
    return Fn(
        name, "nums",
        f"The list of {what} for each pair of neighbours in nums, in order; [] when nums has "
        "fewer than two numbers.",
        f"return [{expr} for a, b in zip(nums, nums[1:])]",
        one([], [4], [1, 1], [3, 8, 2], ints(rng, 6), ints(rng, 8)), [([1, 4, 9, 7],)],
    )  # fmt: skip


@template("keep_copies")
def _keep_copies(rng: random.Random, i: int) -> Fn:
    def at_most(k: int) -> str:
        return (
            "seen = {}\nout = []\nfor n in nums:\n    seen[n] = seen.get(n, 0) + 1\n"
            f"    if seen[n] <= {k}:\n        out.append(n)\nreturn out"
        )

    name, doc, body = [
        ("unique_keep_first", "nums without repeated values: the first occurrence of each value "
         "is kept, in order.", at_most(1)),
        ("keep_at_most_two", "nums with only the first two occurrences of each value kept, in "
         "order.", at_most(2)),
        ("keep_at_most_three", "nums with only the first three occurrences of each value kept, "
         "in order.", at_most(3)),
        ("unique_keep_last", "nums without repeated values: the last occurrence of each value is "
         "kept, in the original order.",
         "out = []\nfor k, n in enumerate(nums):\n    if n not in nums[k + 1:]:\n"
         "        out.append(n)\nreturn out"),
        ("values_seen_once", "The values that occur exactly once in nums, in order.",
         "return [n for n in nums if nums.count(n) == 1]"),
    ][i]  # fmt: skip
    cases = one([], [1], [1, 1, 1, 1], [3, 1, 3, 2, 1, 3], ints(rng, 10, 0, 4), ints(rng, 12, 0, 3))
    return Fn(name, "nums", doc, body, cases, [([5, 2, 5, 5, 1, 2, 5],)])


@template("rotate")
def _rotate(rng: random.Random, i: int) -> Fn:
    side, k = [("left", 1), ("left", 2), ("right", 1), ("right", 3), ("left", 4)][i]
    head, tail = ("front", "end") if side == "left" else ("end", "front")
    doc = f"Rotate nums {side} by {counted(k, 'position')}: the elements shifted off the {head} "
    doc += f"come back in at the {tail}."
    body = f"if not nums:\n    return []\nk = {k} % len(nums)\n"
    body += "return nums[k:] + nums[:k]" if side == "left" else "return nums[-k:] + nums[:-k]"
    doc += " The shift is taken modulo the length of nums, and [] stays []."
    return Fn(
        f"rotate_{side}_{k}", "nums", doc, body,
        one([], [1], [1, 2], [1, 2, 3], [1, 2, 3, 4, 5], ints(rng, 7)),
        [([10, 20, 30, 40, 50, 60],)],
    )  # fmt: skip


@template("flatten")
def _flatten(rng: random.Random, i: int) -> Fn:
    flat = "[x for inner in lists for x in inner]"
    name, doc, body = [
        ("flatten_one_level", "Flatten a list of lists by one level: the items of each inner "
         "list, in order.", f"return {flat}"),
        ("flatten_sorted", "The items of all the inner lists of a list of lists, sorted in "
         "ascending order.", f"return sorted({flat})"),
        ("flatten_reversed", "The items of all the inner lists of a list of lists, in reverse "
         "order (the last item of the last list first).", f"return {flat}[::-1]"),
        ("flatten_unique", "The items of all the inner lists of a list of lists, in order, "
         "keeping only the first occurrence of each value.",
         f"out = []\nfor x in {flat}:\n    if x not in out:\n        out.append(x)\nreturn out"),
        ("count_nested_items", "The total number of items in the inner lists of a list of lists.",
         "return sum(len(inner) for inner in lists)"),
    ][i]  # fmt: skip
    nested = [[ints(rng, rng.randint(0, 3), 0, 6) for _ in range(rng.randint(2, 4))] for _ in "ab"]
    cases = one([], [[]], [[1], [2, 3]], [[3, 1], [], [2, 3]], *nested)
    return Fn(name, "lists", doc, body, cases, [([[4, 2], [], [2, 7, 1]],)])


@template("chunks")
def _chunks(rng: random.Random, i: int) -> Fn:
    k, partial = [(2, True), (3, True), (4, True), (2, False), (3, False)][i]
    if partial:
        name, doc = f"chunks_of_{k}", f"the last chunk may have fewer than {k}"
        body = f"return [nums[i:i + {k}] for i in range(0, len(nums), {k})]"
    else:
        name, doc = f"full_chunks_of_{k}", f"a last chunk with fewer than {k} is dropped"
        body = f"return [nums[i:i + {k}] for i in range(0, len(nums) - {k} + 1, {k})]"
    return Fn(
        name, "nums",
        f"Split nums into consecutive chunks of {k} elements, in order; {doc}.", body,
        one([], [1], list(range(1, k + 1)), list(range(1, k + 2)), list(range(1, 2 * k + 1)),
            ints(rng, 7), ints(rng, 9)),
        [([1, 2, 3, 4, 5, 6, 7],)],
    )  # fmt: skip


@template("order_stats")
def _order_stats(rng: random.Random, i: int) -> Fn:
    def nth(pos: int, desc: bool) -> str:
        order = ", reverse=True" if desc else ""
        pick = f"values[{pos}] if len(values) > {pos} else None"
        return f"values = sorted(set(nums){order})\nreturn {pick}"

    name, doc, body = [
        ("second_largest_distinct", "The second largest distinct value of nums; None if nums has "
         "fewer than two distinct values.", nth(1, True)),
        ("third_largest_distinct", "The third largest distinct value of nums; None if nums has "
         "fewer than three distinct values.", nth(2, True)),
        ("second_smallest_distinct", "The second smallest distinct value of nums; None if nums "
         "has fewer than two distinct values.", nth(1, False)),
        ("second_largest_with_repeats", "The second element of nums sorted in decreasing order "
         "(a repeated value counts each time); None if nums has fewer than two elements.",
         "return sorted(nums, reverse=True)[1] if len(nums) > 1 else None"),
        ("third_smallest_distinct", "The third smallest distinct value of nums; None if nums has "
         "fewer than three distinct values.", nth(2, False)),
    ][i]  # fmt: skip
    cases = one(
        [], [4], [4, 4], [1, 2], [5, 5, 3, 3, 1], [-1, -5, 0, -5], ints(rng, 7), ints(rng, 9)
    )
    return Fn(name, "nums", doc, body, cases, [([3, 8, 1, 8, 5, 2],)])


@template("count_in_range")
def _count_in_range(rng: random.Random, i: int) -> Fn:
    lo, hi = [(0, 10), (-5, 5), (1, 3), (10, 20), (-3, 0)][i]
    return Fn(
        f"count_from_{tag(lo)}_to_{tag(hi)}", "nums",
        f"Count the numbers of nums that lie between {lo} and {hi}, both included.",
        f"return sum(1 for n in nums if {lo} <= n <= {hi})",
        one([], [lo], [hi], [lo - 1, hi + 1], ints(rng, 8, lo - 5, hi + 5),
            ints(rng, 10, lo - 5, hi + 5)),
        [(ints(rng, 6, lo - 4, hi + 4),)],
    )  # fmt: skip


@template("running")
def _running(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("running_max", "The list whose element i is the largest of nums[0], ..., nums[i].",
         "out = []\nfor n in nums:\n    out.append(n if not out else max(out[-1], n))\nreturn out"),
        ("running_min", "The list whose element i is the smallest of nums[0], ..., nums[i].",
         "out = []\nfor n in nums:\n    out.append(n if not out else min(out[-1], n))\nreturn out"),
        ("running_sum_mod_10", "The list whose element i is (nums[0] + ... + nums[i]) % 10.",
         "out, total = [], 0\nfor n in nums:\n    total += n\n    out.append(total % 10)\n"
         "return out"),
        ("running_product", "The list whose element i is nums[0] * ... * nums[i].",
         "out, total = [], 1\nfor n in nums:\n    total *= n\n    out.append(total)\nreturn out"),
        ("running_even_count", "The list whose element i is how many of nums[0], ..., nums[i] "
         "are even.",
         "out, count = [], 0\nfor n in nums:\n    count += n % 2 == 0\n    out.append(count)\n"
         "return out"),
    ][i]  # fmt: skip
    cases = one([], [5], [1, 2, 3], [3, -1, 4, 1, -5], ints(rng, 6), ints(rng, 8))
    return Fn(name, "nums", doc, body, cases, [([2, 7, 1, 8, 4],)])


@template("window", "eval")
def _window(rng: random.Random, i: int) -> Fn:
    w, best = [(2, False), (3, False), (2, True), (3, True), (4, False)][i]
    sums = f"[sum(nums[k:k + {w}]) for k in range(len(nums) - {w} + 1)]"
    if best:
        name, body = f"max_window_sum_{w}", f"sums = {sums}\nreturn max(sums) if sums else None"
        doc = f"The largest sum of {w} consecutive elements of nums; None when nums has fewer "
        doc += f"than {w}."
    else:
        name, body = f"window_sums_{w}", f"return {sums}"
        doc = f"The sums of every run of {w} consecutive elements of nums, in order; [] when nums "
        doc += f"has fewer than {w}."
    cases = one([], [1], list(range(1, w + 1)), [5, -2, 7, 0, 3], ints(rng, 7), ints(rng, 9))
    return Fn(name, "nums", doc, body, cases, [([1, 3, -2, 5, 4],)])


@template("first_index_above")
def _first_index_above(rng: random.Random, i: int) -> Fn:
    t = [0, 5, 10, -1, 3][i]
    return Fn(
        f"first_index_above_{tag(t)}", "nums",
        f"The index of the first element of nums that is greater than {t}; -1 if there is none.",
        f"for k, n in enumerate(nums):\n    if n > {t}:\n        return k\nreturn -1",
        one([], [t], [t, t + 1], [t + 5], ints(rng, 6, t - 6, t + 3), ints(rng, 8, t - 6, t + 3)),
        [([t - 3, t, t + 2, t + 7],)],
    )  # fmt: skip


@template("product_mod")
def _product_mod(rng: random.Random, i: int) -> Fn:
    m = [7, 10, 97, 1000, 13][i]
    return Fn(
        f"product_mod_{m}", "nums",
        f"The product of the numbers of nums modulo {m} (a number from 0 to {m - 1}); the "
        "product of no numbers is 1.",
        f"result = 1\nfor n in nums:\n    result = result * n % {m}\nreturn result",
        one([], [0], [5], [m, 2], ints(rng, 5, -20, 20), ints(rng, 8, 1, 50)), [([3, 4, 5, 6],)],
    )  # fmt: skip


@template("clamp")
def _clamp(rng: random.Random, i: int) -> Fn:
    lo, hi = [(0, 10), (-5, 5), (1, 9), (0, 100), (-1, 1)][i]
    return Fn(
        f"clamp_{tag(lo)}_to_{tag(hi)}", "nums",
        f"Each number of nums limited to the range {lo} to {hi}: values below {lo} become "
        f"{lo}, values above {hi} become {hi}, the others stay.",
        f"return [min(max(n, {lo}), {hi}) for n in nums]",
        one([], [lo - 1], [hi + 1], [lo, hi], ints(rng, 7, lo - 10, hi + 10),
            ints(rng, 7, lo - 10, hi + 10)),
        [([lo - 3, lo + 1, hi + 4],)],
    )  # fmt: skip


@template("pair_sums", "eval")
def _pair_sums(rng: random.Random, i: int) -> Fn:
    t = [10, 0, 5, 7, 12][i]
    return Fn(
        f"count_pairs_summing_to_{t}", "nums",
        f"Count the pairs of positions i < j with nums[i] + nums[j] == {t}.",
        f"return sum(1 for i in range(len(nums)) for j in range(i + 1, len(nums)) "
        f"if nums[i] + nums[j] == {t})",
        one([], [t], [t // 2, t - t // 2], [t // 2, t - t // 2, t // 2],
            ints(rng, 6, -5, 15), ints(rng, 8, -5, 15)),
        [([t - 1, 1, t - 3, 3, 1],)],
    )  # fmt: skip


@template("two_lists")
def _two_lists(rng: random.Random, i: int) -> Fn:
    rest = "n = min(len(a), len(b))\n"
    name, doc, body = [
        ("add_lists_padded", "The element-wise sums of a and b; the shorter list counts as "
         "padded with zeros.",
         "from itertools import zip_longest\n"
         "return [x + y for x, y in zip_longest(a, b, fillvalue=0)]"),
        ("multiply_lists", "The element-wise products of a and b, as long as the shorter list.",
         "return [x * y for x, y in zip(a, b)]"),
        ("max_of_lists", "The element-wise maxima of a and b; the extra elements of the longer "
         "list are kept as they are.",
         rest + "return [max(x, y) for x, y in zip(a, b)] + a[n:] + b[n:]"),
        ("subtract_lists_padded", "a[i] - b[i] for every position of the longer list, the "
         "shorter list counting as padded with zeros.",
         "from itertools import zip_longest\n"
         "return [x - y for x, y in zip_longest(a, b, fillvalue=0)]"),
        ("interleave_lists", "The elements of a and b alternated, starting with a; the rest of "
         "the longer list is appended.",
         rest + "out = []\nfor x, y in zip(a, b):\n    out += [x, y]\nreturn out + a[n:] + b[n:]"),
    ][i]  # fmt: skip
    cases = [([], []), ([1], []), ([], [2, 3]), ([1, 2, 3], [4, 5, 6]), ([1, 2], [3, 4, 5, 6]),
             (ints(rng, 4), ints(rng, 3)), (ints(rng, 2), ints(rng, 5))]  # fmt: skip
    return Fn(name, "a, b", doc, body, cases, [([5, 1, 4], [2, 3])])


@template("split_at")
def _split_at(rng: random.Random, i: int) -> Fn:
    t = [0, 5, 10, 3, -2][i]
    return Fn(
        f"split_below_{tag(t)}", "nums",
        f"A tuple (below, rest): the numbers of nums smaller than {t}, and the other numbers, "
        "each part in its original order.",
        f"return ([n for n in nums if n < {t}], [n for n in nums if n >= {t}])",
        one([], [t], [t - 1], [t + 1, t - 1], ints(rng, 6, t - 6, t + 6),
            ints(rng, 9, t - 6, t + 6)),
        [([t + 2, t - 1, t, t - 5, t + 9],)],
    )  # fmt: skip


@template("runs", "eval")
def _runs(rng: random.Random, i: int) -> Fn:
    def longest(cond: str) -> str:
        return (
            f"best = run = 0\nfor n in nums:\n    run = run + 1 if {cond} else 0\n"
            "    best = max(best, run)\nreturn best"
        )

    def chained(cond: str) -> str:
        return (
            f"best = run = 0\nfor k, n in enumerate(nums):\n    run = run + 1 if k and {cond} "
            "else 1\n    best = max(best, run)\nreturn best"
        )

    name, doc, body = [
        ("longest_equal_run", "The length of the longest run of equal neighbouring values in "
         "nums; 0 for [].", chained("nums[k - 1] == n")),
        ("longest_increasing_run", "The length of the longest stretch of consecutive elements "
         "of nums that strictly increases; 0 for [].", chained("nums[k - 1] < n")),
        ("longest_even_run", "The length of the longest stretch of consecutive even numbers in "
         "nums; 0 if there is none.", longest("n % 2 == 0")),
        ("longest_positive_run", "The length of the longest stretch of consecutive positive "
         "numbers in nums; 0 if there is none.", longest("n > 0")),
        ("value_of_longest_run", "The value that forms the longest run of equal neighbouring "
         "values in nums (the first such run on a tie); None for [].",
         "best, best_len, run = None, 0, 0\nfor k, n in enumerate(nums):\n"
         "    run = run + 1 if k and nums[k - 1] == n else 1\n    if run > best_len:\n"
         "        best, best_len = n, run\nreturn best"),
    ][i]  # fmt: skip
    cases = one([], [7], [1, 1, 2, 2, 2, 3], [1, 2, 3, 1, 2], [2, 4, 6, 1, 8], [5, 5],
                ints(rng, 10, -1, 2), ints(rng, 10, 0, 3))  # fmt: skip
    return Fn(name, "nums", doc, body, cases, [([3, 3, 4, 6, 6, 6, 1, 2],)])


@template("frequency")
def _frequency(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("majority_element", "The value that fills more than half of the positions of nums; "
         "None if there is none.",
         "for n in nums:\n    if nums.count(n) * 2 > len(nums):\n        return n\nreturn None"),
        ("most_frequent_smallest", "The most frequent value of nums, the smallest one on a tie; "
         "None for [].",
         "if not nums:\n    return None\nreturn min(set(nums), key=lambda n: (-nums.count(n), n))"),
        ("count_singletons", "How many values occur exactly once in nums.",
         "return sum(1 for n in set(nums) if nums.count(n) == 1)"),
        ("repeated_values", "The values that occur more than once in nums, each listed once, in "
         "order of first appearance.",
         "out = []\nfor n in nums:\n    if nums.count(n) > 1 and n not in out:\n"
         "        out.append(n)\nreturn out"),
        ("most_frequent_first", "The most frequent value of nums, the one that appears first in "
         "nums on a tie; None for [].", "return max(nums, key=nums.count) if nums else None"),
    ][i]  # fmt: skip
    cases = one([], [3], [1, 2, 1], [1, 2, 3], [2, 2, 1, 1], [4, 4, 4, 1, 2],
                ints(rng, 9, 0, 3), ints(rng, 7, 0, 2))  # fmt: skip
    return Fn(name, "nums", doc, body, cases, [([5, 3, 5, 2, 3, 5, 5],)])


@template("drop_every_kth")
def _drop_every_kth(rng: random.Random, i: int) -> Fn:
    k = [2, 3, 4, 5, 6][i]
    return Fn(
        f"drop_every_{ORDINAL[k]}", "nums",
        f"Return nums without every {ORDINAL[k]} element (the elements at positions {k}, "
        f"{2 * k}, {3 * k}, ... counting from 1).",
        f"return [x for pos, x in enumerate(nums, 1) if pos % {k} != 0]",
        one([], [1], list(range(1, k)), list(range(1, k + 1)), list(range(1, 2 * k + 2)),
            ints(rng, 9)),
        [(list(range(10, 10 + 2 * k + 1)),)],
    )  # fmt: skip


@template("mean_stats")
def _mean_stats(rng: random.Random, i: int) -> Fn:
    above = "if not nums:\n    return 0\ntotal = sum(nums)\n"
    name, doc, body = [
        ("mean_rounded_down", "The mean of nums rounded down to an integer (sum // length); 0 "
         "for [].", "return sum(nums) // len(nums) if nums else 0"),
        ("count_above_mean", "How many numbers of nums are strictly greater than the mean of "
         "nums; 0 for [].", above + "return sum(1 for n in nums if n * len(nums) > total)"),
        ("count_below_mean", "How many numbers of nums are strictly smaller than the mean of "
         "nums; 0 for [].", above + "return sum(1 for n in nums if n * len(nums) < total)"),
        ("values_above_mean", "The numbers of nums that are strictly greater than the mean of "
         "nums, in order.",
         "total = sum(nums)\nreturn [n for n in nums if n * len(nums) > total]"),
        ("value_range", "The largest minus the smallest number of nums; 0 for [].",
         "return max(nums) - min(nums) if nums else 0"),
    ][i]  # fmt: skip
    cases = one([], [5], [1, 2, 3], [1, 1, 1, 9], [-4, 0, 7], ints(rng, 6), ints(rng, 8))
    return Fn(name, "nums", doc, body, cases, [([2, 9, 4, 7, 3],)])


@template("rearrange", "eval")
def _rearrange(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("swap_adjacent_pairs", "Swap nums[0] with nums[1], nums[2] with nums[3], and so on; "
         "with an odd length the last element stays in place.",
         "out = list(nums)\nfor k in range(0, len(out) - 1, 2):\n"
         "    out[k], out[k + 1] = out[k + 1], out[k]\nreturn out"),
        ("reverse_each_three", "Reverse each consecutive group of three elements of nums (the "
         "last group may be shorter).",
         "out = []\nfor k in range(0, len(nums), 3):\n    out += nums[k:k + 3][::-1]\nreturn out"),
        ("swap_first_last", "nums with its first and last elements exchanged; a list shorter "
         "than two comes back unchanged.",
         "if len(nums) < 2:\n    return list(nums)\nreturn [nums[-1]] + nums[1:-1] + [nums[0]]"),
        ("evens_first", "The even numbers of nums followed by the odd ones, each group in its "
         "original order.",
         "return [n for n in nums if n % 2 == 0] + [n for n in nums if n % 2 != 0]"),
        ("zeros_to_end", "nums with every 0 moved to the end, the other numbers in their "
         "original order.", "return [n for n in nums if n != 0] + [n for n in nums if n == 0]"),
    ][i]  # fmt: skip
    cases = one([], [1], [1, 2], [1, 2, 3], [0, 1, 0, 2, 3], ints(rng, 6, 0, 5), ints(rng, 7, 0, 5))
    return Fn(name, "nums", doc, body, cases, [([0, 7, 2, 0, 5, 4, 9],)])


@template("sortedness")
def _sortedness(rng: random.Random, i: int) -> Fn:
    name, what, cond = [
        ("is_non_decreasing", "each element of nums is at least the one before it", "a <= b"),
        ("is_strictly_increasing", "each element of nums is greater than the one before it",
         "a < b"),
        ("is_non_increasing", "each element of nums is at most the one before it", "a >= b"),
        ("is_strictly_decreasing", "each element of nums is smaller than the one before it",
         "a > b"),
        ("is_sorted_by_abs", "the absolute value of each element of nums is at least that of "
         "the one before it", "abs(a) <= abs(b)"),
    ][i]  # fmt: skip
    return Fn(
        name, "nums", f"True if {what}; [] and one-element lists count as sorted.",
        f"return all({cond} for a, b in zip(nums, nums[1:]))",
        one([], [1], [1, 1, 2], [1, 2, 3], [3, 2, 2], [3, 2, 1], [-1, 2, -3], ints(rng, 4)),
        [([1, 3, 3, 7],), ([9, 4, 0],)],
    )  # fmt: skip


@template("sorted_lists")
def _sorted_lists(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("merge_sorted_lists", "Merge the ascending lists a and b into one ascending list, "
         "keeping repeated values.", "return sorted(a + b)"),
        ("merge_sorted_distinct", "Merge the ascending lists a and b into one ascending list "
         "with every value once.", "return sorted(set(a) | set(b))"),
        ("common_values", "The values present in both ascending lists a and b, each once, in "
         "ascending order.", "return sorted(set(a) & set(b))"),
        ("only_in_first", "The elements of a that do not occur in b, in the order of a "
         "(repeats kept).", "return [x for x in a if x not in b]"),
        ("count_common_values", "How many distinct values occur in both a and b.",
         "return len(set(a) & set(b))"),
    ][i]  # fmt: skip
    cases = [([], []), ([1], []), ([], [1, 2]), ([1, 3, 5], [2, 3, 4]), ([1, 1, 2], [1, 2, 2]),
             (sorted(ints(rng, 5, 0, 9)), sorted(ints(rng, 4, 0, 9))),
             (sorted(ints(rng, 3, 0, 9)), sorted(ints(rng, 6, 0, 9)))]  # fmt: skip
    return Fn(name, "a, b", doc, body, cases, [([1, 2, 4, 4, 7], [2, 3, 4, 8])])


# ---------------------------------------------------------------- arithmetic


@template("digits")
def _digits(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("digit_sum", "The sum of the decimal digits of the non-negative integer n.",
         "return sum(int(d) for d in str(n))"),
        ("digit_product", "The product of the decimal digits of the non-negative integer n.",
         "result = 1\nfor d in str(n):\n    result *= int(d)\nreturn result"),
        ("count_even_digits", "How many of the decimal digits of the non-negative integer n are "
         "even (0 counts as even).", "return sum(1 for d in str(n) if int(d) % 2 == 0)"),
        ("largest_digit", "The largest decimal digit of the non-negative integer n.",
         "return max(int(d) for d in str(n))"),
        ("number_of_digits", "How many decimal digits the non-negative integer n has.",
         "return len(str(n))"),
    ][i]  # fmt: skip
    cases = one(0, 7, 10, 99, 1203, rng.randint(10**5, 10**6), rng.randint(100, 999), 4444)
    return Fn(name, "n", doc, body, cases, [(2024,)])


@template("primes")
def _primes(rng: random.Random, i: int) -> Fn:
    trial = "all(m % k for k in range(2, int(m ** 0.5) + 1))"
    name, doc, body, cases = [
        ("is_prime", "True if n is a prime number (n may be any integer).",
         "if n < 2:\n    return False\nk = 2\nwhile k * k <= n:\n    if n % k == 0:\n"
         "        return False\n    k += 1\nreturn True",
         [-7, 0, 1, 2, 9, 17, 25, rng.randint(50, 200)]),
        ("count_primes_below", "How many prime numbers are smaller than n.",
         f"return sum(1 for m in range(2, n) if {trial})", [0, 2, 3, 10, 30, rng.randint(40, 150)]),
        ("next_prime", "The smallest prime number greater than n (n may be any integer).",
         f"m = max(n + 1, 2)\nwhile not {trial}:\n    m += 1\nreturn m",
         [-5, 0, 2, 13, 24, rng.randint(30, 200)]),
        ("largest_prime_factor", "The largest prime factor of the integer n >= 2.",
         "k, last = 2, 1\nwhile k * k <= n:\n    while n % k == 0:\n        n //= k\n"
         "        last = k\n    k += 1\nreturn n if n > 1 else last",
         [2, 12, 13, 49, 1024, rng.randint(100, 5000)]),
        ("prime_factors", "The prime factors of the integer n >= 1 in ascending order, each "
         "repeated as often as it divides n; [] for 1.",
         "out, k = [], 2\nwhile k * k <= n:\n    while n % k == 0:\n        out.append(k)\n"
         "        n //= k\n    k += 1\nif n > 1:\n    out.append(n)\nreturn out",
         [1, 2, 12, 97, 360, rng.randint(100, 5000)]),
    ][i]  # fmt: skip
    return Fn(name, "n", doc, body, one(*cases), [(20,)])


@template("gcd_lcm")
def _gcd_lcm(rng: random.Random, i: int) -> Fn:
    gcd = "from math import gcd\n"
    pairs = [(12, 18), (7, 5), (1, 9), (21, 14), (rng.randint(2, 60), rng.randint(2, 60))]
    lists = one([], [12], [8, 12, 20], [7, 5], [rng.randint(1, 12) for _ in range(3)])
    name, params, doc, body, cases = [
        ("gcd_of_two", "a, b", "The greatest common divisor of the non-negative integers a and "
         "b; gcd(0, 0) is 0.", gcd + "return gcd(a, b)", [(0, 0), (0, 5), *pairs]),
        ("lcm_of_two", "a, b", "The least common multiple of the positive integers a and b.",
         gcd + "return a * b // gcd(a, b)", pairs),
        ("gcd_of_list", "nums", "The greatest common divisor of the non-negative integers in "
         "nums; 0 for [].",
         gcd + "result = 0\nfor n in nums:\n    result = gcd(result, n)\nreturn result", lists),
        ("lcm_of_list", "nums", "The least common multiple of the positive integers in nums; 1 "
         "for [].",
         gcd + "result = 1\nfor n in nums:\n    result = result * n // gcd(result, n)\n"
         "return result", lists),
        ("are_coprime", "a, b", "True if the positive integers a and b have no common divisor "
         "greater than 1.", gcd + "return gcd(a, b) == 1", pairs),
    ][i]  # fmt: skip
    example = [(24, 36)] if params == "a, b" else [([24, 36, 60],)]
    return Fn(name, params, doc, body, cases, example)


@template("sum_multiples")
def _sum_multiples(rng: random.Random, i: int) -> Fn:
    a, b = [(3, 5), (2, 7), (4, 6), (5, 7), (3, 8)][i]
    return Fn(
        f"sum_multiples_of_{a}_or_{b}", "n",
        f"The sum of the positive integers below n that are multiples of {a} or of {b} (or of "
        "both).",
        f"return sum(k for k in range(1, n) if k % {a} == 0 or k % {b} == 0)",
        one(0, 1, a, a + 1, 20, rng.randint(30, 100), rng.randint(100, 300)), [(10,)],
    )  # fmt: skip


@template("fizz_label")
def _fizz_label(rng: random.Random, i: int) -> Fn:
    a, b, wa, wb = [(3, 5, "Fizz", "Buzz"), (2, 3, "Ping", "Pong"), (4, 7, "Foo", "Bar"),
                    (3, 4, "Tic", "Tac"), (5, 6, "Zip", "Zap")][i]  # fmt: skip
    return Fn(
        f"{wa.lower()}_{wb.lower()}_label", "n",
        f"Return '{wa}{wb}' if n is divisible by both {a} and {b}, '{wa}' if only by {a}, "
        f"'{wb}' if only by {b}, and otherwise n written as a string.",
        f"if n % {a} == 0 and n % {b} == 0:\n    return '{wa}{wb}'\nif n % {a} == 0:\n"
        f"    return '{wa}'\nif n % {b} == 0:\n    return '{wb}'\nreturn str(n)",
        one(1, a, b, a * b, 2 * a * b, a * b + 1, rng.randint(1, 100)), [(a,), (a * b,)],
    )  # fmt: skip


@template("collatz")
def _collatz(rng: random.Random, i: int) -> Fn:
    rule = "the Collatz rule (n // 2 when n is even, 3 * n + 1 when n is odd)"
    step = "n = n // 2 if n % 2 == 0 else 3 * n + 1"
    name, doc, body = [
        ("collatz_steps", f"How many steps {rule} takes to bring the positive integer n to 1.",
         f"steps = 0\nwhile n != 1:\n    {step}\n    steps += 1\nreturn steps"),
        ("collatz_peak", f"The largest value reached, n included, when {rule} is applied to the "
         "positive integer n until it reaches 1.",
         f"peak = n\nwhile n != 1:\n    {step}\n    peak = max(peak, n)\nreturn peak"),
        ("collatz_sequence", f"The list of values from the positive integer n down to 1 under "
         f"{rule}, both ends included.",
         f"out = [n]\nwhile n != 1:\n    {step}\n    out.append(n)\nreturn out"),
        ("collatz_odd_steps", f"How many times the 3 * n + 1 step is taken when {rule} is "
         "applied to the positive integer n until it reaches 1.",
         "count = 0\nwhile n != 1:\n    if n % 2:\n        n = 3 * n + 1\n        count += 1\n"
         "    else:\n        n //= 2\nreturn count"),
        ("collatz_even_values", f"How many even values occur in the sequence from the positive "
         f"integer n down to 1 under {rule}, n included.",
         f"count = 0\nwhile n != 1:\n    count += n % 2 == 0\n    {step}\nreturn count"),
    ][i]  # fmt: skip
    return Fn(name, "n", doc, body, one(1, 2, 3, 6, 7, 12, rng.randint(13, 40)), [(5,)])


@template("figurate", "eval")
def _figurate(rng: random.Random, i: int) -> Fn:
    seq = one(0, 1, 2, 5, 10, rng.randint(11, 60))
    name, doc, body, cases = [
        ("triangular_number", "The n-th triangular number 1 + 2 + ... + n, for n >= 0.",
         "return n * (n + 1) // 2", seq),
        ("pentagonal_number", "The n-th pentagonal number n * (3 * n - 1) / 2, for n >= 0.",
         "return n * (3 * n - 1) // 2", seq),
        ("hexagonal_number", "The n-th hexagonal number n * (2 * n - 1), for n >= 0.",
         "return n * (2 * n - 1)", seq),
        ("is_triangular", "True if the integer n >= 0 is a triangular number (0, 1, 3, 6, 10, "
         "... : the sums 1 + 2 + ... + k).",
         "k = 0\nwhile k * (k + 1) // 2 < n:\n    k += 1\nreturn k * (k + 1) // 2 == n",
         one(0, 1, 2, 10, 11, 55, rng.randint(60, 500))),
        ("is_square", "True if the integer n is a perfect square (n may be negative).",
         "if n < 0:\n    return False\nfrom math import isqrt\nreturn isqrt(n) ** 2 == n",
         one(-4, 0, 1, 2, 49, 50, rng.randint(60, 500))),
    ][i]  # fmt: skip
    return Fn(name, "n", doc, body, cases, [(4,), (6,)])


@template("to_base", "eval")
def _to_base(rng: random.Random, i: int) -> Fn:
    b = [2, 3, 5, 7, 8][i]
    return Fn(
        f"to_base_{b}", "n",
        f"The non-negative integer n written in base {b}, as a string of digits with the most "
        "significant first ('0' for 0).",
        f"if n == 0:\n    return '0'\ndigits = ''\nwhile n:\n    digits = str(n % {b}) + digits\n"
        f"    n //= {b}\nreturn digits",
        one(0, 1, b - 1, b, b * b, rng.randint(10, 500), rng.randint(500, 5000)), [(100,)],
    )  # fmt: skip


@template("from_base")
def _from_base(rng: random.Random, i: int) -> Fn:
    b = [2, 3, 6, 8, 16][i]
    alphabet = "0123456789abcdef"[:b]
    extra = " (0-9 and a-f)" if b == 16 else ""
    return Fn(
        f"from_base_{b}", "digits",
        f"The value of digits, a non-empty string of base-{b} digits{extra}, most significant "
        "first.",
        f"return int(digits, {b})",
        one("0", "1", "10", alphabet[-1] * 3, chars(rng, alphabet, 4), chars(rng, alphabet, 6)),
        [("1" + alphabet[-1] + "0",)],
    )  # fmt: skip


@template("reverse_digits")
def _reverse_digits(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("reverse_integer", "The integer whose decimal digits are those of n in reverse order, "
         "with the sign of n; leading zeros of the result are dropped.",
         "r = int(str(abs(n))[::-1])\nreturn -r if n < 0 else r"),
        ("is_digit_palindrome", "True if the decimal digits of the non-negative integer n read "
         "the same backwards.", "return str(n) == str(n)[::-1]"),
        ("add_reversed", "n plus the number formed by the decimal digits of the non-negative "
         "integer n in reverse order.", "return n + int(str(n)[::-1])"),
        ("first_plus_last_digit", "The sum of the first and the last decimal digit of the "
         "non-negative integer n (for a one-digit n, that digit twice).",
         "s = str(n)\nreturn int(s[0]) + int(s[-1])"),
        ("rotate_digits_left", "The number formed by moving the first decimal digit of the "
         "non-negative integer n to the end; leading zeros of the result are dropped.",
         "s = str(n)\nreturn int(s[1:] + s[0])"),
    ][i]  # fmt: skip
    signed = [-123, -50] if name == "reverse_integer" else []
    cases = one(0, 7, 120, 1221, 12345, rng.randint(1000, 99999), *signed)
    return Fn(name, "n", doc, body, cases, [(3071,)])


@template("base_palindrome")
def _base_palindrome(rng: random.Random, i: int) -> Fn:
    b = [2, 3, 5, 7, 9][i]
    return Fn(
        f"is_palindrome_in_base_{b}", "n",
        f"True if the digits of the non-negative integer n written in base {b} read the same "
        "backwards (0 counts as a palindrome).",
        f"digits = []\nwhile n:\n    digits.append(n % {b})\n    n //= {b}\n"
        "return digits == digits[::-1]",
        one(0, 1, b, b + 1, b * b + 1, b * b + 2, rng.randint(20, 400), rng.randint(20, 400)),
        [(2 * b * b + 2,), (2 * b * b + 1,)],
    )  # fmt: skip


@template("divisors")
def _divisors(rng: random.Random, i: int) -> Fn:
    proper = "sum(d for d in range(1, n) if n % d == 0)"
    name, doc, body = [
        ("count_divisors", "How many positive divisors the positive integer n has (1 and n "
         "included).", "return sum(1 for d in range(1, n + 1) if n % d == 0)"),
        ("sum_proper_divisors", "The sum of the positive divisors of the positive integer n "
         "that are smaller than n (0 for n = 1).", f"return {proper}"),
        ("is_perfect", "True if the positive integer n equals the sum of its positive divisors "
         "smaller than itself.", f"return {proper} == n"),
        ("divisors_of", "The positive divisors of the positive integer n, in ascending order.",
         "return [d for d in range(1, n + 1) if n % d == 0]"),
        ("is_abundant", "True if the sum of the positive divisors of the positive integer n "
         "that are smaller than n is greater than n.", f"return {proper} > n"),
    ][i]  # fmt: skip
    cases = one(1, 6, 12, 28, 13, rng.randint(14, 99), rng.randint(100, 300))
    return Fn(name, "n", doc, body, cases, [(18,)])


@template("factorials")
def _factorials(rng: random.Random, i: int) -> Fn:
    fact = "from math import factorial\n"
    name, doc, body = [
        ("factorial_trailing_zeros", "How many zeros n! ends with in decimal, for n >= 0.",
         "count = 0\nwhile n:\n    n //= 5\n    count += n\nreturn count"),
        ("factorial_digit_count", "How many decimal digits n! has, for n >= 0.",
         fact + "return len(str(factorial(n)))"),
        ("factorial_digit_sum", "The sum of the decimal digits of n!, for n >= 0.",
         fact + "return sum(int(d) for d in str(factorial(n)))"),
        ("double_factorial", "n!! = n * (n - 2) * (n - 4) * ..., down to 1 or 2; 1 for n = 0 "
         "or n = 1.", "result = 1\nwhile n > 1:\n    result *= n\n    n -= 2\nreturn result"),
        ("factorial_mod_97", "n! modulo 97, for n >= 0.",
         "result = 1\nfor k in range(2, n + 1):\n    result = result * k % 97\nreturn result"),
    ][i]  # fmt: skip
    return Fn(name, "n", doc, body, one(0, 1, 5, 10, 25, rng.randint(30, 60)), [(7,)])


@template("linear_recurrence")
def _linear_recurrence(rng: random.Random, i: int) -> Fn:
    a, b = [(0, 1), (2, 1), (1, 3), (3, 4), (5, 2)][i]
    return Fn(
        f"sequence_from_{a}_{b}", "n",
        f"The sequence s starts s(0) = {a}, s(1) = {b}, and every later term is the sum of the "
        "two before it. Return s(n) for n >= 0.",
        f"x, y = {a}, {b}\nfor _ in range(n):\n    x, y = y, x + y\nreturn x",
        one(0, 1, 2, 5, 10, rng.randint(15, 40)), [(6,)],
    )  # fmt: skip


@template("is_power")
def _is_power(rng: random.Random, i: int) -> Fn:
    k = [3, 5, 4, 10, 6][i]
    return Fn(
        f"is_power_of_{k}", "n",
        f"True if n equals {k} ** j for some integer j >= 0 (so 1 counts); n may be any integer.",
        f"if n < 1:\n    return False\nwhile n % {k} == 0:\n    n //= {k}\nreturn n == 1",
        one(-k, 0, 1, k, k * k + 1, k**5, 2 * k, rng.randint(2, 1000)), [(k**3,), (k**3 - 1,)],
    )  # fmt: skip


@template("digital_root", "eval")
def _digital_root(rng: random.Random, i: int) -> Fn:
    def repeat(op: str, result: str) -> str:
        return f"steps = 0\nwhile n >= 10:\n    n = {op}\n    steps += 1\nreturn {result}"

    dsum, dprod = "sum(int(d) for d in str(n))", "__import__('math').prod(int(d) for d in str(n))"
    name, doc, body = [
        ("digital_root", "Replace the non-negative integer n by the sum of its decimal digits "
         "until one digit is left, and return that digit.", repeat(dsum, "n")),
        ("additive_persistence", "How many times the non-negative integer n must be replaced by "
         "the sum of its decimal digits until it has one digit.", repeat(dsum, "steps")),
        ("multiplicative_persistence", "How many times the non-negative integer n must be "
         "replaced by the product of its decimal digits until it has one digit.",
         repeat(dprod, "steps")),
        ("multiplicative_root", "Replace the non-negative integer n by the product of its "
         "decimal digits until one digit is left, and return that digit.", repeat(dprod, "n")),
        ("digit_sum_chain", "The list n, then the sum of its decimal digits, then the sum of "
         "that one's digits, and so on, ending with the first one-digit value.",
         f"out = [n]\nwhile n >= 10:\n    n = {dsum}\n    out.append(n)\nreturn out"),
    ][i]  # fmt: skip
    cases = one(0, 7, 10, 38, 999, 679, rng.randint(10**4, 10**7))
    return Fn(name, "n", doc, body, cases, [(9875,)])


@template("power_sums")
def _power_sums(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("sum_of_squares_to", "1 * 1 + 2 * 2 + ... + n * n for the integer n >= 0.",
         "return sum(k * k for k in range(1, n + 1))"),
        ("sum_of_cubes_to", "1 ** 3 + 2 ** 3 + ... + n ** 3 for the integer n >= 0.",
         "return sum(k ** 3 for k in range(1, n + 1))"),
        ("alternating_sum_to", "1 - 2 + 3 - 4 + ..., up to and including n, for the integer "
         "n >= 0 (0 for n = 0).", "return sum(k if k % 2 else -k for k in range(1, n + 1))"),
        ("sum_of_odds_to", "The sum of the odd numbers from 1 to n, for the integer n >= 0.",
         "return sum(range(1, n + 1, 2))"),
        ("sum_of_evens_to", "The sum of the even numbers from 2 to n, for the integer n >= 0.",
         "return sum(range(2, n + 1, 2))"),
    ][i]  # fmt: skip
    return Fn(name, "n", doc, body, one(0, 1, 2, 3, 10, rng.randint(11, 50)), [(5,)])


@template("round_multiple", "eval")
def _round_multiple(rng: random.Random, i: int) -> Fn:
    m, mode = [(5, "nearest"), (10, "nearest"), (3, "down"), (4, "up"), (25, "nearest")][i]
    name, doc, body = {
        "nearest": (f"round_to_nearest_{m}", f"The multiple of {m} nearest to the integer n; a "
                    "value exactly halfway rounds up.", f"return (n + {m // 2}) // {m} * {m}"),
        "down": (f"round_down_to_{m}", f"The largest multiple of {m} that is not greater than "
                 "the integer n.", f"return n // {m} * {m}"),
        "up": (f"round_up_to_{m}", f"The smallest multiple of {m} that is not smaller than the "
               "integer n.", f"return -(-n // {m}) * {m}"),
    }[mode]  # fmt: skip
    cases = one(0, m, m // 2, m + 1, -m - 1, rng.randint(-100, 100), rng.randint(100, 999))
    return Fn(name, "n", doc, body, cases, [(2 * m + m // 2 + 1,)])


@template("count_div_not")
def _count_div_not(rng: random.Random, i: int) -> Fn:
    a, b = [(3, 2), (2, 4), (5, 3), (4, 8), (7, 2)][i]
    return Fn(
        f"count_multiples_of_{a}_not_{b}", "n",
        f"How many of the integers 1, 2, ..., n are divisible by {a} but not by {b}.",
        f"return sum(1 for k in range(1, n + 1) if k % {a} == 0 and k % {b} != 0)",
        one(0, 1, a, a * b, rng.randint(20, 100), rng.randint(100, 500)), [(30,)],
    )  # fmt: skip


@template("clock")
def _clock(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("minutes_to_clock", "A non-negative number of minutes as 'H:MM': hours (not limited to "
         "24, no leading zero) and two-digit minutes.",
         "return '{}:{:02d}'.format(n // 60, n % 60)"),
        ("seconds_to_hms", "A non-negative number of seconds as 'H:MM:SS': hours (no leading "
         "zero), then two-digit minutes and seconds.",
         "return '{}:{:02d}:{:02d}'.format(n // 3600, n // 60 % 60, n % 60)"),
        ("minutes_to_day_time", "The time of day 'HH:MM' (24-hour clock, two-digit hours and "
         "minutes) n minutes after midnight; n may span several days.",
         "n %= 1440\nreturn '{:02d}:{:02d}'.format(n // 60, n % 60)"),
        ("minutes_to_text", "A non-negative number of minutes as hours and minutes in the form "
         "'<h>h <m>m', with no padding.", "return '{}h {}m'.format(n // 60, n % 60)"),
        ("seconds_to_minutes", "A non-negative number of seconds as 'M:SS': minutes (not limited "
         "to 60, no leading zero) and two-digit seconds.",
         "return '{}:{:02d}'.format(n // 60, n % 60)"),
    ][i]  # fmt: skip
    cases = one(0, 5, 59, 60, 61, 1439, 1470, rng.randint(2000, 90000))
    return Fn(name, "n", doc, body, cases, [(125,)])


@template("bits")
def _bits(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("count_set_bits", "How many 1 bits the binary form of the non-negative integer n has.",
         "return bin(n).count('1')"),
        ("trailing_zero_bits", "How many 0 bits the binary form of the positive integer n ends "
         "with.", "count = 0\nwhile n % 2 == 0:\n    n //= 2\n    count += 1\nreturn count"),
        ("binary_length", "How many binary digits the non-negative integer n needs (0 for 0).",
         "return n.bit_length()"),
        ("has_odd_bit_count", "True if the binary form of the non-negative integer n has an odd "
         "number of 1 bits.", "return bin(n).count('1') % 2 == 1"),
        ("highest_power_of_two_in", "The largest power of two that is not greater than the "
         "positive integer n.", "p = 1\nwhile p * 2 <= n:\n    p *= 2\nreturn p"),
    ][i]  # fmt: skip
    cases = one(1, 2, 7, 8, 12, 255, rng.randint(256, 5000), rng.randint(3, 100))
    return Fn(name, "n", doc, body, cases, [(40,)])


# ---------------------------------------------------------------- dicts


@template("word_counts")
def _word_counts(rng: random.Random, i: int) -> Fn:
    def counting(items: str) -> str:
        return (
            f"counts = {{}}\nfor w in {items}:\n    counts[w] = counts.get(w, 0) + 1\nreturn counts"
        )

    name, doc, body = [
        ("word_counts", "A dict mapping each word of text (split on whitespace; case matters) "
         "to how many times it occurs.", counting("text.split()")),
        ("word_counts_nocase", "A dict mapping each word of text (split on whitespace), "
         "lower-cased, to how many times it occurs in any case.", counting("text.lower().split()")),
        ("long_word_counts", "A dict mapping each word of text (split on whitespace) with at "
         "least 4 characters to how many times it occurs.",
         counting("[w for w in text.split() if len(w) >= 4]")),
        ("letter_counts", "A dict mapping each letter of text, lower-cased, to how many times "
         "it occurs in any case; other characters are not counted.",
         counting("[ch for ch in text.lower() if ch.isalpha()]")),
        ("char_counts_without_spaces", "A dict mapping each character of text other than the "
         "space to how many times it occurs.", counting("[ch for ch in text if ch != ' ']")),
    ][i]  # fmt: skip
    cases = one("", "a", "a A a", "The cat the Cat", sentence(rng, 4, 8), sentence(rng, 6, 9))
    return Fn(name, "text", doc, body, cases, [("to be or not to be",)])


@template("invert")
def _invert(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("invert_mapping", "A dict with the keys and values of mapping swapped (the values of "
         "mapping are all different).", "return {v: k for k, v in mapping.items()}"),
        ("invert_to_key_lists", "A dict mapping each value of mapping to the list of keys that "
         "have it, in the order of mapping.",
         "out = {}\nfor k, v in mapping.items():\n    out.setdefault(v, []).append(k)\nreturn out"),
        ("count_values", "A dict mapping each value of mapping to how many keys have it.",
         "out = {}\nfor v in mapping.values():\n    out[v] = out.get(v, 0) + 1\nreturn out"),
        ("keys_sorted_by_value", "The keys of mapping sorted by their values, smallest first; "
         "keys with equal values in alphabetical order.",
         "return sorted(mapping, key=lambda k: (mapping[k], k))"),
        ("invert_keep_last", "A dict with the keys and values of mapping swapped; when several "
         "keys share a value, the last of them in the order of mapping wins.",
         "return {v: k for k, v in mapping.items()}"),
    ][i]  # fmt: skip
    if name == "invert_mapping":
        distinct = [
            dict(zip(rng.sample("abcdefgh", n), rng.sample(range(10), n), strict=True))
            for n in (3, 5)
        ]
        cases = one({}, {"a": 1}, {"x": 2, "y": 1}, *distinct)
        return Fn(name, "mapping", doc, body, cases, [({"one": 1, "two": 2},)])
    cases = one({}, {"a": 1}, {"x": 2, "y": 2}, small_dict(rng, 4), small_dict(rng, 6),
                small_dict(rng, 5, 1))  # fmt: skip
    return Fn(name, "mapping", doc, body, cases, [({"b": 2, "a": 1, "c": 2},)])


@template("group_first")
def _group_first(rng: random.Random, i: int) -> Fn:
    def group(key: str, items: str) -> str:
        return f"out = {{}}\nfor x in {items}:\n    out.setdefault({key}, []).append(x)\nreturn out"

    name, params, doc, body = [
        ("group_by_first_letter", "words", "A dict mapping each first letter, lower-cased, to "
         "the list of the words (non-empty strings) that start with it in any case, in order.",
         group("x[0].lower()", "words")),
        ("group_by_last_letter", "words", "A dict mapping each last letter, lower-cased, to the "
         "list of the words (non-empty strings) that end with it in any case, in order.",
         group("x[-1].lower()", "words")),
        ("group_by_remainder_3", "nums", "A dict mapping each remainder n % 3 that occurs to the "
         "list of the numbers of nums with that remainder, in order.", group("x % 3", "nums")),
        ("group_by_remainder_4", "nums", "A dict mapping each remainder n % 4 that occurs to the "
         "list of the numbers of nums with that remainder, in order.", group("x % 4", "nums")),
        ("count_by_first_letter", "words", "A dict mapping each first letter, lower-cased, to "
         "how many of the words (non-empty strings) start with it in any case.",
         "out = {}\nfor w in words:\n    out[w[0].lower()] = out.get(w[0].lower(), 0) + 1\n"
         "return out"),
    ][i]  # fmt: skip
    if params == "nums":
        cases = one([], [3], [1, 2, 3, 4, 5, 6], [-1, -4, 7], ints(rng, 6, 0, 20), ints(rng, 8))
        return Fn(name, params, doc, body, cases, [([4, 9, 12, 7, 3],)])
    cases = one([], ["a"], ["Apple", "avocado", "Banana"], words(rng, 5), words(rng, 8))
    return Fn(name, params, doc, body, cases, [(["bee", "Ant", "bat", "cow"],)])


@template("merge_counts")
def _merge_counts(rng: random.Random, i: int) -> Fn:
    total = "out = dict(a)\nfor k, v in b.items():\n    out[k] = out.get(k, 0) + v\n"
    name, doc, body = [
        ("merge_counts", "A new dict with every key of the dicts a and b; a key in both gets "
         "the sum of its two values.", total + "return out"),
        ("merge_keep_max", "A new dict with every key of the dicts a and b; a key in both gets "
         "the larger of its two values.",
         "out = dict(a)\nfor k, v in b.items():\n    out[k] = max(out[k], v) if k in out else v\n"
         "return out"),
        ("merge_common_keys", "A dict of the keys present in both dicts a and b, each mapped to "
         "the sum of its two values.", "return {k: a[k] + b[k] for k in a if k in b}"),
        ("merge_counts_at_least_3", "Sum the dicts a and b key by key (a missing key counts as "
         "0) and keep only the keys whose total is at least 3.",
         total + "return {k: v for k, v in out.items() if v >= 3}"),
        ("subtract_counts", "The dict a with the values of b subtracted key by key (a missing "
         "key counts as 0), keeping only the keys of a whose result is positive.",
         "out = {k: v - b.get(k, 0) for k, v in a.items()}\n"
         "return {k: v for k, v in out.items() if v > 0}"),
    ][i]  # fmt: skip
    cases = [({}, {}), ({"x": 1}, {}), ({}, {"y": 2}), ({"a": 2, "b": 1}, {"b": 2, "c": 5}),
             (small_dict(rng, 3), small_dict(rng, 4)),
             (small_dict(rng, 5), small_dict(rng, 3))]  # fmt: skip
    return Fn(name, "a, b", doc, body, cases, [({"x": 3, "y": 1}, {"y": 4, "z": 2})])


@template("max_key", "eval")
def _max_key(rng: random.Random, i: int) -> Fn:
    name, doc, body = [
        ("max_value_key", "The key of scores with the largest value, the alphabetically smallest "
         "key on a tie; None for {}.",
         "if not scores:\n    return None\nreturn min(scores, key=lambda k: (-scores[k], k))"),
        ("min_value_key", "The key of scores with the smallest value, the alphabetically "
         "smallest key on a tie; None for {}.",
         "if not scores:\n    return None\nreturn min(scores, key=lambda k: (scores[k], k))"),
        ("top_two_keys", "The list of the two keys of scores with the largest values, largest "
         "first, ties broken by the alphabetically smaller key; fewer if scores has fewer keys.",
         "return sorted(scores, key=lambda k: (-scores[k], k))[:2]"),
        ("first_max_value_key", "The key of scores with the largest value, the first one in the "
         "order of scores on a tie; None for {}.",
         "return max(scores, key=scores.get) if scores else None"),
        ("keys_with_max_value", "All keys of scores that have the largest value, in alphabetical "
         "order; [] for {}.",
         "if not scores:\n    return []\nbest = max(scores.values())\n"
         "return sorted(k for k in scores if scores[k] == best)"),
    ][i]  # fmt: skip
    cases = one({}, {"a": 1}, {"b": 2, "a": 2}, {"x": 5, "y": 9, "z": 1}, small_dict(rng, 5),
                small_dict(rng, 6), small_dict(rng, 4, 1))  # fmt: skip
    return Fn(name, "scores", doc, body, cases, [({"tom": 7, "ann": 9, "bob": 9},)])


@template("keep_above")
def _keep_above(rng: random.Random, i: int) -> Fn:
    t = [0, 5, 10, 2, -1][i]
    return Fn(
        f"keep_values_above_{tag(t)}", "mapping",
        f"A dict of the items of mapping whose value is greater than {t}, in the same order.",
        f"return {{k: v for k, v in mapping.items() if v > {t}}}",
        one({}, {"a": t}, {"a": t + 1}, {"a": t - 1, "b": t + 3},
            {k: v + t - 2 for k, v in small_dict(rng, 5, 5).items()},
            {k: v + t - 3 for k, v in small_dict(rng, 6, 6).items()}),
        [({"x": t + 4, "y": t, "z": t + 1},)],
    )  # fmt: skip


@template("group_length", "eval")
def _group_length(rng: random.Random, i: int) -> Fn:
    def group(key: str) -> str:
        return f"out = {{}}\nfor x in items:\n    out.setdefault({key}, []).append(x)\nreturn out"

    vowels = "sum(1 for ch in x if ch in 'aeiou')"
    name, doc, body, numeric = [
        ("group_by_length", "A dict mapping each length to the list of the strings of items "
         "with that length, in order.", group("len(x)"), False),
        ("group_by_length_sorted", "A dict mapping each length to the alphabetically sorted "
         "list, without repeats, of the strings of items with that length.",
         "out = {}\nfor x in sorted(set(items)):\n    out.setdefault(len(x), []).append(x)\n"
         "return out", False),
        ("group_by_vowel_count", "A dict mapping a number of vowels (a, e, i, o, u; lower case) "
         "to the list of the strings of items with that many vowels, in order.",
         group(vowels), False),
        ("group_by_digit_count", "A dict mapping each number of decimal digits to the list of "
         "the non-negative integers of items with that many digits, in order.",
         group("len(str(x))"), True),
        ("group_by_sign", "A dict with the keys 'negative', 'zero' and 'positive' (always all "
         "three), each mapped to the list of the numbers of items with that sign, in order.",
         "out = {'negative': [], 'zero': [], 'positive': []}\nfor x in items:\n"
         "    out['negative' if x < 0 else 'zero' if x == 0 else 'positive'].append(x)\n"
         "return out", True),
    ][i]  # fmt: skip
    if numeric:
        lo = 0 if name == "group_by_digit_count" else -50
        cases = one([], [5], [0, 10, 7, 100], ints(rng, 6, lo, 500), ints(rng, 8, lo, 99))
        return Fn(name, "items", doc, body, cases, [([12, 5, 300, 0, 41],)])
    cases = one([], ["a"], ["bb", "a", "cc", "bb"], words(rng, 6), words(rng, 8))
    return Fn(name, "items", doc, body, cases, [(["owl", "bee", "ant", "eel", "cat"],)])


# ---------------------------------------------------------------- parsing


@template("kv_pairs")
def _kv_pairs(rng: random.Random, i: int) -> Fn:
    ps, kv, as_int, name = [(";", "=", False, "parse_semicolon_pairs"),
                            (",", ":", True, "parse_comma_int_pairs"),
                            ("&", "=", False, "parse_query_pairs"),
                            ("|", "=", True, "parse_bar_int_pairs"),
                            (";", ":", False, "parse_colon_pairs")][i]  # fmt: skip
    kind = " of int values" if as_int else " of string values"
    value = "int(value)" if as_int else "value"
    pieces = [f"{k}{kv}{rng.randint(0, 99)}" for k in rng.sample("abcxyz", 4)]
    return Fn(
        name, "text",
        f"Parse text made of key{kv}value pieces separated by {ps!r} into a dict{kind}; empty "
        "pieces are skipped, a later key replaces an earlier one, and '' gives {}.",
        f"out = {{}}\nfor piece in text.split({ps!r}):\n    if piece:\n"
        f"        key, _, value = piece.partition({kv!r})\n        out[key] = {value}\nreturn out",
        one("", f"a{kv}1", f"a{kv}1{ps}b{kv}2", f"a{kv}1{ps}{ps}b{kv}2{ps}",
            f"x{kv}1{ps}x{kv}2", ps.join(pieces), ps.join(pieces[:2])),
        [(f"id{kv}7{ps}n{kv}42",)],
    )  # fmt: skip


@template("brackets")
def _brackets(rng: random.Random, i: int) -> Fn:
    pairs, name = [("()", "is_balanced_parens"), ("[]", "is_balanced_square"),
                   ("()[]", "is_balanced_round_square"), ("()[]{}", "is_balanced_brackets"),
                   ("<>{}", "is_balanced_angle_curly")][i]  # fmt: skip
    opens, closes = pairs[0::2], pairs[1::2]
    match = dict(zip(closes, opens, strict=True))
    listed = ", ".join(f"{o} {c}" for o, c in zip(opens, closes, strict=True))
    o, c = opens[0], closes[0]
    o2, c2 = opens[-1], closes[-1]

    def balanced(depth: int) -> str:
        k = rng.randrange(len(opens))
        inner = "".join(balanced(depth - 1) for _ in range(rng.randint(0, 2))) if depth else "x"
        return opens[k] + inner + closes[k]

    good = balanced(3) + balanced(2)
    return Fn(
        name, "text",
        f"True if the brackets {listed} in text are balanced and properly nested; every other "
        "character is ignored.",
        f"match = {match!r}\nstack = []\nfor ch in text:\n    if ch in {opens!r}:\n"
        "        stack.append(ch)\n    elif ch in match:\n"
        "        if not stack or stack.pop() != match[ch]:\n            return False\n"
        "return not stack",
        one("", o + c, o + o2 + c2 + c, c + o, o + "a" + c + c, o + o2 + c + c2, good,
            good[:-1]),
        [(f"{o}a{o2}b{c2}{c}",), (f"{o}{c}{c}",)],
    )  # fmt: skip


@template("nesting", "eval")
def _nesting(rng: random.Random, i: int) -> Fn:
    def depth(o: str, c: str) -> str:
        return (
            f"depth = best = 0\nfor ch in text:\n    if ch == {o!r}:\n        depth += 1\n"
            f"        best = max(best, depth)\n    elif ch == {c!r}:\n        depth -= 1\n"
            "return best"
        )

    name, doc, body, balanced = [
        ("max_paren_depth", "The deepest nesting level of the parentheses in text, whose "
         "parentheses are balanced; 0 if there are none.", depth("(", ")"), "()"),
        ("max_bracket_depth", "The deepest nesting level of the square brackets in text, whose "
         "brackets are balanced; 0 if there are none.", depth("[", "]"), "[]"),
        ("count_top_level_groups", "How many outermost parenthesised groups text has (its "
         "parentheses are balanced).",
         "depth = count = 0\nfor ch in text:\n    if ch == '(':\n        count += depth == 0\n"
         "        depth += 1\n    elif ch == ')':\n        depth -= 1\nreturn count", "()"),
        ("count_matched_pairs", "How many ')' of text close an earlier '(' that is still open, "
         "each '(' closed at most once.",
         "open_count = pairs = 0\nfor ch in text:\n    if ch == '(':\n        open_count += 1\n"
         "    elif ch == ')' and open_count:\n        open_count -= 1\n        pairs += 1\n"
         "return pairs", ""),
        ("min_additions_to_balance", "The smallest number of '(' or ')' characters that must be "
         "inserted into text to make its parentheses balanced.",
         "open_count = missing = 0\nfor ch in text:\n    if ch == '(':\n        open_count += 1\n"
         "    elif ch == ')':\n        if open_count:\n            open_count -= 1\n"
         "        else:\n            missing += 1\nreturn open_count + missing", ""),
    ][i]  # fmt: skip
    o, c = (balanced or "()")[0], (balanced or "()")[1]
    shapes = ["", "abc", o + c, o + o + c + c + o + c, f"{o}{o}a{c}{o}b{o}c{c}{c}{c}x",
              f"{o}{c}{o}{o}{o}{c}{c}{c}"]  # fmt: skip
    if not balanced:
        shapes = [s for s in shapes if s != "abc"] + [")(", "(()", "))(((" + chars(rng, "()", 6)]
    shown = f"a{o}b{o}c{c}{c}{o}{c}" if balanced else "())((a)"
    return Fn(name, "text", doc, body, one(*shapes), [(shown,)])


@template("numbers_in_text", "eval")
def _numbers_in_text(rng: random.Random, i: int) -> Fn:
    found = "import re\nnumbers = [int(m) for m in re.findall('[0-9]+', text)]\n"
    name, doc, body = [
        ("sum_numbers_in_text", "The sum of the whole numbers written in text, a number being a "
         "maximal run of digits; 0 if there are none.", found + "return sum(numbers)"),
        ("largest_number_in_text", "The largest of the whole numbers written in text, a number "
         "being a maximal run of digits; -1 if there are none.",
         found + "return max(numbers) if numbers else -1"),
        ("count_numbers_in_text", "How many whole numbers are written in text, a number being a "
         "maximal run of digits.", found + "return len(numbers)"),
        ("numbers_in_text", "The list of the whole numbers written in text, in order, a number "
         "being a maximal run of digits (leading zeros are dropped).", found + "return numbers"),
        ("sum_digits_in_text", "The sum of all the digit characters of text, each counted as one "
         "digit.", "return sum(int(ch) for ch in text if ch.isdigit())"),
    ][i]  # fmt: skip
    cases = one(
        "", "abc", "a12b3", "7 apples and 15 pears", "x007y", chars(rng, "ab0123456789 ", 14)
    )
    return Fn(name, "text", doc, body, cases, [("room 101, floor 3",)])


@template("int_list")
def _int_list(rng: random.Random, i: int) -> Fn:
    sep, label = [(",", "comma"), (";", "semicolon"), (" ", "space"), ("|", "bar"),
                  (":", "colon")][i]  # fmt: skip
    what = "spaces" if sep == " " else f"{sep!r} characters"
    values = [str(n) for n in ints(rng, 5, -20, 99)]
    return Fn(
        f"parse_{label}_ints", "text",
        f"The list of the integers in text, which are separated by {what}; an item may have "
        "spaces around it, and empty items are skipped.",
        f"return [int(p) for p in text.split({sep!r}) if p.strip()]",
        one("", "5", f"1{sep}2{sep}3", f" 4 {sep} -2 ", f"1{sep}{sep}2{sep}", sep.join(values)),
        [(f"10{sep}-3{sep}7",)],
    )  # fmt: skip


@template("expressions")
def _expressions(rng: random.Random, i: int) -> Fn:
    def expr(ops: str, spaced: bool = False) -> str:
        out = str(rng.randint(0, 20))
        for _ in range(rng.randint(2, 4)):
            gap = " " * rng.randint(0, 1) if spaced else ""
            out += gap + rng.choice(ops) + gap + str(rng.randint(0, 20))
        return out

    scan = (
        "total, sign, number = 0, 1, 0\nfor ch in {src} + '+':\n    if ch.isdigit():\n"
        "        number = number * 10 + int(ch)\n    else:\n        total += sign * number\n"
        "        sign, number = (1 if ch == '+' else -1), 0\nreturn total"
    )
    products = (
        "values = []\nfor term in expr.split({op!r}):\n    product = 1\n"
        "    for factor in term.split('*'):\n        product *= int(factor)\n"
        "    values.append(product)\n"
    )
    name, doc, body, ops, spaced = [
        ("evaluate_plus_minus", "The value of expr: non-negative whole numbers joined by '+' "
         "and '-', with no spaces.", scan.format(src="expr"), "+-", False),
        ("evaluate_spaced_plus_minus", "The value of expr: non-negative whole numbers joined by "
         "'+' and '-', with or without spaces around the signs.",
         scan.format(src="expr.replace(' ', '')"), "+-", True),
        ("evaluate_plus_times", "The value of expr: non-negative whole numbers joined by '+' and "
         "'*', with no spaces; '*' is done before '+'.",
         products.format(op="+") + "return sum(values)", "+*", False),
        ("evaluate_left_to_right", "The value of expr: non-negative whole numbers joined by '+', "
         "'-' and '*', with no spaces, each operation done strictly from left to right (no "
         "precedence).",
         "value, op, number = 0, '+', 0\nfor ch in expr + '+':\n    if ch.isdigit():\n"
         "        number = number * 10 + int(ch)\n        continue\n    if op == '+':\n"
         "        value += number\n    elif op == '-':\n        value -= number\n    else:\n"
         "        value *= number\n    op, number = ch, 0\nreturn value", "+-*", False),
        ("evaluate_times_minus", "The value of expr: non-negative whole numbers joined by '*' "
         "and '-', with no spaces; '*' is done before '-'.",
         products.format(op="-") + "return values[0] - sum(values[1:])", "*-", False),
    ][i]  # fmt: skip
    cases = one("7", "0", "10" + ops[0] + "2" + ops[-1] + "3", *(expr(ops, spaced) for _ in "abc"))
    return Fn(name, "expr", doc, body, cases, [("2" + ops[-1] + "3" + ops[0] + "4",)])


@template("time_parse", "eval")
def _time_parse(rng: random.Random, i: int) -> Fn:
    def clock(seconds: bool = False) -> str:
        hms = [rng.randint(0, 23), rng.randint(0, 59)] + ([rng.randint(0, 59)] if seconds else [])
        return ":".join(f"{v:02d}" for v in hms)

    minutes = "int({t}[:2]) * 60 + int({t}[3:5])"
    name, params, doc, body, cases = [
        ("clock_to_minutes", "text", "The number of minutes after midnight of the time text, "
         "'HH:MM' on a 24-hour clock.", "return " + minutes.format(t="text"),
         one("00:00", "00:59", "01:00", "23:59", clock(), clock())),
        ("clock_to_seconds", "text", "The number of seconds after midnight of the time text, "
         "'HH:MM:SS' on a 24-hour clock.",
         "h, m, s = text.split(':')\nreturn int(h) * 3600 + int(m) * 60 + int(s)",
         one("00:00:00", "00:00:59", "01:00:00", "23:59:59", clock(True), clock(True))),
        ("minutes_between", "start, end", "The minutes from the time start to the time end, both "
         "'HH:MM' on a 24-hour clock; an end earlier than start is on the next day.",
         "s = " + minutes.format(t="start") + "\ne = " + minutes.format(t="end")
         + "\nreturn (e - s) % 1440",
         [("10:00", "10:00"), ("09:15", "10:00"), ("23:30", "00:15"), ("00:00", "23:59"),
          (clock(), clock()), (clock(), clock())]),
        ("twelve_hour_to_minutes", "text", "The number of minutes after midnight of a 12-hour "
         "time 'h:MM am' or 'h:MM pm' (12:00 am is midnight, 12:00 pm is noon).",
         "clock, half = text.split()\nhours, mins = clock.split(':')\n"
         "return (int(hours) % 12 + (12 if half == 'pm' else 0)) * 60 + int(mins)",
         one("12:00 am", "12:30 pm", "1:05 am", "11:59 pm",
             f"{rng.randint(1, 12)}:{rng.randint(0, 59):02d} {rng.choice(['am', 'pm'])}")),
        ("duration_to_minutes", "text", "The number of minutes in a duration such as '2h 15m': "
         "an optional hours part '<h>h' and an optional minutes part '<m>m', separated by a "
         "space; '' is 0.",
         "total = 0\nfor part in text.split():\n    if part.endswith('h'):\n"
         "        total += int(part[:-1]) * 60\n    else:\n        total += int(part[:-1])\n"
         "return total",
         one("", "45m", "3h", "1h 1m", f"{rng.randint(2, 30)}h {rng.randint(0, 59)}m")),
    ][i]  # fmt: skip
    shown: dict[str, list[Args]] = {
        "clock_to_minutes": [("07:45",)],
        "clock_to_seconds": [("01:02:03",)],
        "minutes_between": [("22:10", "01:05")],
        "twelve_hour_to_minutes": [("7:05 pm",)],
        "duration_to_minutes": [("2h 15m",)],
    }
    return Fn(name, params, doc, body, cases, shown[name])


@template("symbol_words")
def _symbol_words(rng: random.Random, i: int) -> Fn:
    sym, label = [("#", "hashtags"), ("@", "mentions"), ("$", "dollar_words"),
                  ("!", "bang_words"), ("%", "percent_words")][i]  # fmt: skip
    tagged = " ".join(rng.choice([w, sym + w]) for w in words(rng, 6))
    return Fn(
        f"extract_{label}", "text",
        f"The words of text (split on whitespace) that start with {sym!r}, without that first "
        f"{sym!r}, in order; a word that is only {sym!r} is skipped.",
        f"return [w[1:] for w in text.split() if w.startswith({sym!r}) and len(w) > 1]",
        one("", "no tags here", f"{sym}one two {sym}three", f"{sym} {sym}{sym}x a{sym}b", tagged),
        [(f"hello {sym}world and {sym}python",)],
    )  # fmt: skip


@template("versions")
def _versions(rng: random.Random, i: int) -> Fn:
    def version(parts: int = 3) -> str:
        return ".".join(str(rng.randint(0, 12)) for _ in range(parts))

    padded = (
        "pa = [int(p) for p in a.split('.')]\npb = [int(p) for p in b.split('.')]\n"
        "n = max(len(pa), len(pb))\npa += [0] * (n - len(pa))\npb += [0] * (n - len(pb))\n"
    )
    rule = "versions are dot-separated non-negative integers compared part by part as numbers"
    key = "key=lambda v: [int(p) for p in v.split('.')]"
    pairs = [("1.2", "1.2.0"), ("1.10", "1.9"), ("2.0", "10.0"), ("1.0.1", "1.0"),
             (version(2), version(3)), (version(), version())]  # fmt: skip
    lists = one(["1.0.0"], ["1.2.10", "1.2.9", "1.10.0"], [version() for _ in "abcd"],
                ["0.1.0", "0.1.0", "0.0.9"], [version() for _ in "abcde"])  # fmt: skip
    name, params, doc, body, cases = [
        ("compare_versions", "a, b", f"-1 if version a is older than b, 1 if newer, 0 if equal; "
         f"{rule}, a missing part counting as 0 (so '1.2' equals '1.2.0').",
         padded + "return (pa > pb) - (pa < pb)", pairs),
        ("is_newer_version", "a, b", f"True if version a is newer than version b; {rule}, a "
         "missing part counting as 0.", padded + "return pa > pb", pairs),
        ("latest_version", "versions", f"The newest of the non-empty list versions, each "
         f"'major.minor.patch'; {rule}; the first one on a tie.",
         f"return max(versions, {key})", lists),
        ("sort_versions", "versions", f"The list versions, each 'major.minor.patch', sorted "
         f"from oldest to newest; {rule}; equal versions keep their order.",
         f"return sorted(versions, {key})", lists),
        ("bump_patch", "version", "The version string with its last dot-separated number "
         "increased by one.",
         "parts = version.split('.')\nparts[-1] = str(int(parts[-1]) + 1)\nreturn '.'.join(parts)",
         one("0", "1.2.9", "1.9.99", version(), version(2), version(4))),
    ][i]  # fmt: skip
    examples: dict[str, list[Args]] = {
        "a, b": [("1.10.0", "1.9.3")],
        "versions": [(["2.0.1", "2.0.10", "2.0.2"],)],
        "version": [("3.4.9",)],
    }
    return Fn(name, params, doc, body, cases, examples[params])


# ---------------------------------------------------------------- building the rows


def call(name: str, args: Args) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def source(fn: Fn) -> str:
    """The reference body, indented as a function body (``canonical_solution``)."""
    return textwrap.indent(textwrap.dedent(fn.body).strip("\n"), "    ") + "\n"


def prompt_of(fn: Fn, shown: list[tuple[Args, Any]]) -> str:
    lines = textwrap.wrap(
        fn.doc, 92, initial_indent='    """', subsequent_indent="    ", break_on_hyphens=False
    )
    for args, out in shown:
        lines += [f"    >>> {call(fn.name, args)}", f"    {out!r}"]
    return f"def {fn.name}({fn.params}):\n" + "\n".join(lines) + '\n    """\n'


def test_of(results: list[tuple[Args, Any]]) -> str:
    lines = ["def check(candidate):"]
    for args, out in results:
        op = "is" if out is None or isinstance(out, bool) else "=="
        lines.append(f"    assert {call('candidate', args)} {op} {out!r}")
    return "\n".join(lines) + "\n"


def plain(value: Any) -> bool:
    """True if ``value`` is plain data that its repr rebuilds exactly (what a test can hold)."""
    try:
        return repr(ast.literal_eval(repr(value))) == repr(value)
    except (ValueError, SyntaxError):
        return False


def run(program: str, entry: str, args: Args) -> Any:
    ns: dict[str, Any] = {}
    exec(compile(program, "<reference>", "exec"), ns)
    return ns[entry](*copy.deepcopy(args))


def passes(program: str, test: str, entry: str) -> bool:
    ns: dict[str, Any] = {}
    exec(compile(program, "<program>", "exec"), ns)
    exec(compile(test, "<test>", "exec"), ns)
    try:
        ns["check"](ns[entry])
    except AssertionError:
        return False
    return True


def build(t: Template, i: int) -> dict[str, str]:
    """One row; ValueError for a problem that breaks a rule of the module docstring."""
    fn = t.make(random.Random(f"{t.name}/{i}"), i)
    where = f"pyfuncs/{t.name}/{i} ({fn.name})"
    body = source(fn)
    bare = f"def {fn.name}({fn.params}):\n{body}"
    cases = list({repr(a): a for a in fn.cases}.values())
    results = [(a, run(bare, fn.name, a)) for a in cases]
    shown = [(a, run(bare, fn.name, a)) for a in fn.examples]
    if not 4 <= len(results) <= 8 or not 1 <= len(shown) <= 2:
        raise ValueError(f"{where}: {len(results)} tests and {len(shown)} examples")
    if len({repr(out) for _, out in results}) < 2:
        raise ValueError(f"{where}: every test expects the same answer")
    if any(out is None for _, out in shown):
        raise ValueError(f"{where}: a doctest example cannot show None")
    if not all(plain(a) and plain(out) for a, out in results + shown):
        raise ValueError(f"{where}: a test value is not plain data")
    prompt, test = prompt_of(fn, shown), test_of(results)
    if not passes(prompt + body, test, fn.name):
        raise ValueError(f"{where}: the reference fails its own test")
    if passes(prompt + "    return None\n", test, fn.name):
        raise ValueError(f"{where}: 'return None' passes the test")
    return {
        "task_id": f"pyfuncs/{t.name}/{i}",
        "prompt": prompt,
        "entry_point": fn.name,
        "test": test,
        "canonical_solution": body,
        "split": t.split,
    }


def rows() -> list[dict[str, str]]:
    """Every problem, variant by variant across the templates (see the module rules)."""
    names = [t.name for t in TEMPLATES]
    if len(set(names)) != len(names):
        raise ValueError("two templates share a name")
    out = [build(t, i) for i in range(PER_TEMPLATE) for t in TEMPLATES]
    entries = [r["entry_point"] for r in out]
    if len(set(entries)) != len(entries):
        raise ValueError("two problems share a function name")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", nargs="?", type=Path, default=OUT, help=f"default: {OUT}")
    path: Path = parser.parse_args(argv).out
    table = rows()
    path.write_bytes("".join(json.dumps(r) + "\n" for r in table).encode())
    train = sum(r["split"] == "train" for r in table)
    print(
        f"{path}: {len(table)} problems, {train} train and {len(table) - train} eval, "
        f"from {len(TEMPLATES)} templates"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
