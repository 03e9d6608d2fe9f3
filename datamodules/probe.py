"""Routing probes: byte sequences whose every token carries a difficulty label known by construction.

``--data probe/<task>`` (``arith``, ``recall``, ``text``) or ``--data probe`` (the three mixed, one
family per episode) is an ordinary corpus of the registry: ``LMDataModule`` caches, packs, splits,
shards (DDP) and resumes it exactly like the embedded corpus. The data are generated, never downloaded:
episode ``i`` comes from ``numpy.random.default_rng([DATA_SEED, i])``, so every process and every DDP
rank builds the same bytes (only rank 0 writes the cache; the others open it).

Tokens are bytes (the ``bytes`` tokenizer: 256 byte ids + EOT), so a probe model's head is small and a
sequence is readable. The stream is a run of fixed-length episodes of ``EPISODE_LEN`` tokens, each
opening with EOT. Beside ``tokens.bin`` the cache folder holds ``levels.npy`` (int8 per token, the
difficulty level; ``-1`` = no label: random or natural-text tokens nobody can predict exactly) and
``families.npy`` (int8, the task family of the episode). A label is meaningful for a model only when
its whole episode is in the model's context: with ``block_size`` a multiple of ``EPISODE_LEN`` every
block holds whole episodes; otherwise the evaluation drops labels whose episode began before the block
(``label_usable``).

The difficulty level of a token is the number of sequential operations on earlier tokens the
generator applied to produce it (0..MAX_DEPTH; 0..BOUNCE_WIDE_LEVELS in v6; 0..1 in v7 and v8: what a level counts
per family is ``LEVEL_MEANINGS``). Eight versions exist; ``v1`` stays reproducible under its
names (``probe``, ``probe/<family>``), ``v2`` has its own (``probe-v2``, ``probe-v2/<family>``) and
changes only the arithmetic family:

* ``arith`` (variable-depth computation): segments ``x0 x1 .. xd = y ;`` of decimal digits with
  ``y = (x0 + .. + xd) mod 10`` and d uniform in 0..MAX_DEPTH, mixed in one episode. ``y`` has
  level d (d = 0: a copy), ``;`` level 0; the operands and ``=`` are unlabelled.
* ``arith`` in ``v2`` (learnable by a 4-layer d=64 model in minutes): fixed-width segments
  ``__x0x1..xd=SS;`` with the operands right-aligned in ``MAX_DEPTH + 1`` slots (``_`` = empty slot),
  ``SS`` the two-digit sum *without* modulus, then ``;``. The units digit of ``SS`` has level d, ``;``
  level 0; operands, blanks, ``=`` and the tens digit are unlabelled (the tens digit is not uniform over
  ten values, so its chance accuracy differs per level; the units digit's is 0.1 at every level). Why
  v1 is not learnable at this scale: ``sum mod 10`` is independent of every single operand, so no
  partial solution lowers the loss (a parity-like plateau; vanilla stayed at ln 10 for 3,000 steps),
  while a plain sum moves with each operand, and the fixed width puts every operand at a fixed offset
  from ``=``.
* ``recall`` (long-range, multi-hop): a table of letter pairs ``k t`` opens the episode (``t`` a letter
  that is itself a key, or a digit); chains of 1..3 hops end in a digit. After ``|`` come counting
  runs of capitals ``KLMN..`` (each letter after the first: level 0, locally predictable) and queries
  ``? k v`` whose answer ``v`` (the digit at the end of k's chain) has level = hops (1..3).
* ``text`` (spans in natural language): the embedded corpus's bytes with three spans inserted:
  a memo ``\\x02 abcd \\x03``, a counting run ``\\x07 3456..`` (digits after the first: level 0) and a
  copy ``\\x05 abcd \\x06`` of the memo (copied letters and the closing byte: level 1). Text bytes are
  unlabelled.

``v3`` (``probe-v3/hops``, family ``hops``) is a level axis that needs sequential depth rather than
width (a ``v2`` sum of d operands is one parallel read for attention):

* ``hops`` (pointer chasing): a memory of 52 cells at fixed positions, cell i holding the value of the
  i-th name of ``a..z A..Z``: the next name of its chain (same case) or a digit (the chain's end). The
  chains are disjoint and open (every name in exactly one, no cycle, so f^k never equals f^(k-N)). After
  ``|`` (level 0) come 16 queries ``qa``: q the first name of a queried chain (each queried chain once),
  a its digit, level = the chain's length 1..4, i.e. the number of dependent lookups, each reading the
  cell named by the previous one's result. The query names and the padding ``.`` are unlabelled.

``v4`` (``probe-v4/cups``, family ``cups``) is state tracking with every operand at a fixed offset:

* ``cups`` (the shell game): 16 fixed-width queries ``s__47=a`` (4 per level, shuffled): a ball under
  cup s of CUPS, k = 1..CUPS_LEVELS operand digits right-aligned in CUPS_LEVELS slots, each naming a swap
  of two cups (``SWAPS``) applied in order; a, the ball's cup after them, has level k (each swap's
  effect depends on where the previous ones left the ball). ``=`` level 0; start, slots, padding unlabelled.

``v5`` (``probe-v5/bounce``, family ``bounce``) is one fixed operation composed in order, in v2's layout:

* ``bounce``: v2's segments ``__x0x1..xd=SS;`` (the same operand draws), ``SS`` the two-digit result of
  s = x0, then for each further operand x: s + x, or |s - x| when s + x would pass BOUNCE_LIMIT. Whether
  a step adds or reflects depends on the state the earlier steps left, so the units digit of ``SS`` (level
  d) needs the d steps in order; mostly a sum, so each operand moves it (v2's learnability).

``v6`` (``probe-v6/bounce``, family ``bounce``) is v5's step over wider segments:

* ``bounce`` with BOUNCE_WIDE_LEVELS + 1 = 8 operand slots (segments of 12 bytes, 10 per episode), d uniform in
  0..7: levels 5-7 need more steps than a one-layer model's table of input combinations can hold (10^6 and
  more), so shallow readings stop at their ceilings (tests/test_probe_bounce_wide.py) while a layer per step,
  or per two, stays small. ``--callbacks.probe_levels`` defaults to 8 here (``level_count``).

``v7`` (``probe-v7/shift``, family ``shift``) tells a read at a fixed position from a read at a fixed distance:

* ``shift``: ``C:C|`` (SHIFT_PREFIX random capitals and their copy, at fixed positions: level 0), 0..SHIFT_MAX_BEFORE
  dots, ``A|A`` (SHIFT_LETTERS distinct lowercase letters and their copy: level 1). The copy of A is SHIFT_LETTERS + 1
  bytes after its source wherever the source lies, and lies at no fixed position: learned position embeddings
  read a fixed position in one layer, a fixed distance at a moving position only through the reader's position.

``v8`` (``probe-v8/induct``, family ``induct``) moves the copy away from its source by a drawn gap:

* ``induct``: v7's ``C:C|`` (level 0), 0..INDUCT_MAX_BEFORE dots, SHIFT_LETTERS distinct lowercase letters, ``|``,
  1..INDUCT_MAX_GAP dots, the same letters (level 1 from the copy's second letter on: the first follows the drawn
  dots). Neither the position nor the distance of the answer is fixed; what gives it is the content: the letter
  that followed the copy's previous letter in the source. Finding that earlier occurrence and reading the letter
  after it is an induction head's two steps (a head that marks each token's predecessor, then one that matches
  on it), which one attention layer cannot compose.

``solve_episode`` re-derives every label from the tokens alone by brute force (for ``hops``: the fewest
lookups, breadth-first, that reach a digit); the tests check the generator against it.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from datamodules.corpora import Corpus, DataError
from datamodules.files import atomic_npy

EPISODE_LEN = 128
MAX_DEPTH = 4
MAX_HOPS = 3
DATA_SEED = 20240615  # the probe content is fixed; --seed changes the training order only
DEFAULT_EPISODES = 16384  # 2.1M tokens; data.max_tokens sets another size
NO_LABEL = -1
FAMILIES = ("arith", "recall", "text", "hops", "cups", "bounce", "shift", "induct")  # families.npy holds the index: append only
VERSIONS = {"probe": "v1", "probe-v2": "v2", "probe-v3": "v3", "probe-v4": "v4", "probe-v5": "v5", "probe-v6": "v6",
            "probe-v7": "v7", "probe-v8": "v8"}  # name prefix -> generator version
_V1_FAMILIES = ("arith", "recall", "text")
TASKS: Dict[str, Tuple[str, ...]] = {
    **{name: families for prefix in ("probe", "probe-v2")
       for name, families in [(prefix, _V1_FAMILIES), *((f"{prefix}/{f}", (f,)) for f in _V1_FAMILIES)]},
    "probe-v3/hops": ("hops",),
    "probe-v4/cups": ("cups",),
    "probe-v5/bounce": ("bounce",),
    "probe-v6/bounce": ("bounce",),
    "probe-v7/shift": ("shift",),
    "probe-v8/induct": ("induct",),
}
BLANK = "_"  # an empty operand slot of a v2 arithmetic segment

# v3 pointer chasing: a query needs 1..HOPS_LEVELS dependent lookups
HOPS_LEVELS = 4
HOPS_PER_LEVEL = 2  # queried chains of each length per alphabet (lower and upper case): 4 queries per level
BAR = "|"  # ends the memory

# v4 state tracking: a query applies 1..CUPS_LEVELS swaps of two cups, in order, to the ball's cup
CUPS = 5
SWAPS = tuple((i, j) for i in range(CUPS) for j in range(i + 1, CUPS))  # operand digit d swaps the cups SWAPS[d]
MOVES = tuple(tuple(j if c == i else i if c == j else c for c in range(CUPS)) for i, j in SWAPS)  # MOVES[d][cup]
CUPS_LEVELS = 4
CUPS_PER_LEVEL = 4  # queries of each level per episode
CUPS_SEGMENT = 1 + CUPS_LEVELS + 2  # start, operand slots, '=', answer

# v5 a fixed non-associative operation composed in order: s <- s + x, or |s - x| when the sum passes the limit
BOUNCE_LIMIT = 14
# v6 the same step over wider segments: levels 0..BOUNCE_WIDE_LEVELS, past what one layer's MLP can tabulate
BOUNCE_WIDE_LEVELS = 7

# v7 copies: one at fixed positions (level 0), one at a fixed distance from a source that moves (level 1)
SHIFT_PREFIX = 8  # the fixed-position part: PREFIX capitals, ':', the same capitals
SHIFT_LETTERS = 20  # the moving part: distinct lowercase letters, '|', the same letters
SHIFT_SEP = "|"
COPY_LEVELS = 2  # v7 and v8: level 0, the copy at fixed positions; level 1, the moved copy

# v8 v7's layout with a drawn gap between the letters' '|' and their copy: the copy is read by content (induction)
INDUCT_MAX_GAP = 34  # dots between '|' and the copy: 1..34
INDUCT_MAX_BEFORE = EPISODE_LEN - 1 - (2 * SHIFT_PREFIX + 2) - (2 * SHIFT_LETTERS + 1) - INDUCT_MAX_GAP  # 0..34
SHIFT_MAX_BEFORE = EPISODE_LEN - 1 - (2 * SHIFT_PREFIX + 2) - (2 * SHIFT_LETTERS + 1)  # dots before the letters: 0..68

MEMO, MEMO_END, COPY, COPY_END, COUNT = "\x02", "\x03", "\x05", "\x06", "\x07"
_MARKERS = {ord(c) for c in (MEMO, MEMO_END, COPY, COPY_END, COUNT)}
_DIGITS = "0123456789"
_KEYS = "abcdefghijklmnopqrstuvwxyz"
_CAPS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NAMES = _KEYS + _CAPS  # v3 variable names: each is bound at most once in an episode

Episode = Tuple[bytes, List[int]]  # EPISODE_LEN - 1 bytes after the EOT, and their levels


# ---------------------------------------------------------------------------- the three families
def arith_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    text, levels = [], []
    while True:
        d = int(rng.integers(0, MAX_DEPTH + 1))
        operands = rng.integers(0, 10, size=d + 1)
        segment = "".join(_DIGITS[x] for x in operands) + "=" + _DIGITS[int(operands.sum()) % 10] + ";"
        if len(text) + len(segment) > length:
            break
        text.extend(segment)
        levels.extend([NO_LABEL] * (d + 2) + [d, 0])
    pad = length - len(text)
    return ("".join(text) + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def arith_episode_v2(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    width = MAX_DEPTH + 1
    segment_len = width + 4  # slots, '=', two sum digits, ';'
    text, levels = [], []
    for _ in range(length // segment_len):
        d = int(rng.integers(0, MAX_DEPTH + 1))
        operands = rng.integers(0, 10, size=d + 1)
        slots = BLANK * (width - d - 1) + "".join(_DIGITS[x] for x in operands)
        text.extend(f"{slots}={int(operands.sum()):02d};")
        levels.extend([NO_LABEL] * (width + 2) + [d, 0])
    pad = length - len(text)
    return ("".join(text) + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def recall_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    hops_per_chain = [MAX_HOPS] + [int(h) for h in rng.integers(1, MAX_HOPS + 1, size=3)]
    letters = list(rng.permutation(len(_KEYS))[: sum(hops_per_chain)])
    pairs, depth_of = [], {}  # depth_of[key] = (hops to the digit, the digit)
    for hops in hops_per_chain:
        chain = [_KEYS[letters.pop()] for _ in range(hops)]
        digit = _DIGITS[int(rng.integers(0, 10))]
        for j, key in enumerate(chain):
            pairs.append(key + (chain[j + 1] if j + 1 < hops else digit))
            depth_of[key] = (hops - j, digit)
    order = rng.permutation(len(pairs))
    text = "".join(pairs[i] for i in order) + "|"
    levels = [NO_LABEL] * len(text)
    by_level = {h: sorted(k for k, (d, _) in depth_of.items() if d == h) for h in range(1, MAX_HOPS + 1)}
    last = ""
    while True:
        if rng.random() < 0.5:
            level = int(rng.integers(1, MAX_HOPS + 1))
            key = by_level[level][int(rng.integers(0, len(by_level[level])))]
            piece, piece_levels = "?" + key + depth_of[key][1], [NO_LABEL, NO_LABEL, level]
        else:
            start, run = int(rng.integers(0, 26)), int(rng.integers(3, 9))
            if last in _CAPS and start == (_CAPS.index(last) + 1) % 26:
                start = (start + 1) % 26  # a run never continues the previous one: its first letter is new
            piece = "".join(_CAPS[(start + j) % 26] for j in range(run))
            piece_levels = [NO_LABEL] + [0] * (run - 1)
        if len(text) + len(piece) > length:
            break
        text += piece
        levels += piece_levels
        last = piece[-1]
    pad = length - len(text)
    return (text + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def text_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1, source: Optional[bytes] = None) -> Episode:
    source = embedded_bytes() if source is None else source
    memo = "".join(_KEYS[int(i)] for i in rng.integers(0, 26, size=int(rng.integers(4, 7))))
    count_start, count_len = int(rng.integers(0, 10)), int(rng.integers(4, 9))
    spans = [
        (MEMO + memo + MEMO_END, [NO_LABEL] * (len(memo) + 2)),
        (COUNT + "".join(_DIGITS[(count_start + j) % 10] for j in range(count_len)), [NO_LABEL, NO_LABEL] + [0] * (count_len - 1)),
        (COPY + memo + COPY_END, [NO_LABEL] + [1] * (len(memo) + 1)),
    ]
    text_len = length - sum(len(s) for s, _ in spans)
    cuts = np.sort(rng.integers(0, text_len + 1, size=3))
    pieces = np.diff(np.concatenate([[0], cuts, [text_len]]))  # four text pieces around the three spans
    offset = int(rng.integers(0, len(source) - text_len))
    natural = source[offset : offset + text_len]
    out, levels, pos = bytearray(), [], 0
    for i, n in enumerate(pieces):
        out += natural[pos : pos + n]
        levels += [NO_LABEL] * int(n)
        pos += int(n)
        if i < len(spans):
            out += spans[i][0].encode("ascii")
            levels += spans[i][1]
    count_end = out.index(COUNT.encode()) + 1 + count_len
    if count_end < len(out) and out[count_end] == ord(_DIGITS[(count_start + count_len) % 10]):
        out[count_end] = ord(" ")  # text right after the run must not look like its continuation
    return bytes(out), levels


def hops_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    """v3 pointer chasing: a memory of one cell per name (``a..z`` then ``A..Z``, fixed positions), each
    holding the next name of its chain (same case) or a digit (the chain's end), ``|``, then one query
    ``qa`` per queried chain: q its first name, a its digit, level = the chain's length (the dependent
    lookups from q to a: each reads the cell named by the previous one's result). '.' pads."""
    memory, asked = {}, []
    for alphabet in (_KEYS, _CAPS):
        queried = [n for n in range(1, HOPS_LEVELS + 1) for _ in range(HOPS_PER_LEVEL)]
        lengths = queried + _distractor_lengths(rng, len(alphabet) - sum(queried))
        order = iter(rng.permutation(len(alphabet)).tolist())  # each name in one chain: no cycle, no shared node
        for i, n in enumerate(lengths):
            chain = [alphabet[next(order)] for _ in range(n)] + [_DIGITS[int(rng.integers(0, 10))]]
            memory.update(zip(chain[:-1], chain[1:]))
            if i < len(queried):
                asked.append((chain[0], chain[-1], n))
    text = "".join(memory[name] for name in _NAMES) + BAR
    levels = [NO_LABEL] * len(_NAMES) + [0]
    for i in rng.permutation(len(asked)).tolist():  # each queried chain once: no answer repeats an earlier one
        head, digit, n = asked[i]
        text += head + digit
        levels += [NO_LABEL, n]
    if len(text) > length:
        raise ValueError(f"hops episodes need {len(text)} bytes, got length {length}")
    pad = length - len(text)
    return (text + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def _distractor_lengths(rng: np.random.Generator, total: int) -> List[int]:
    """Lengths in 1..HOPS_LEVELS summing to ``total``: unqueried chains, so that the digits in memory are
    not the multiset of the answers (no answer by elimination)."""
    out = []
    while total > 0:
        out.append(int(rng.integers(1, min(HOPS_LEVELS, total) + 1)))
        total -= out[-1]
    return out


def cups_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    """v4 state tracking (the shell game): CUPS_LEVELS * CUPS_PER_LEVEL fixed-width queries ``s__47=a``
    in shuffled level order: s the ball's starting cup, k operand digits right-aligned in CUPS_LEVELS
    slots (``_`` = empty), each naming a swap of two cups (SWAPS), applied in order; a the ball's cup
    after the k swaps, level k (each swap's effect depends on where the previous ones left the ball);
    '=' level 0 (at a fixed offset); start, slots and the '.' padding are unlabelled."""
    text, levels = "", []
    for k in rng.permutation(np.repeat(np.arange(1, CUPS_LEVELS + 1), CUPS_PER_LEVEL)).tolist():
        start, operands = int(rng.integers(0, CUPS)), rng.integers(0, len(SWAPS), size=k).tolist()
        slots = BLANK * (CUPS_LEVELS - k) + "".join(_DIGITS[d] for d in operands)
        text += f"{start}{slots}={shell_game(start, operands)}"
        levels += [NO_LABEL] * (1 + CUPS_LEVELS) + [0, k]
    if len(text) > length:
        raise ValueError(f"cups episodes need {len(text)} bytes, got length {length}")
    pad = length - len(text)
    return (text + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def shell_game(ball: int, operands: List[int]) -> int:
    """The ball's cup after the swaps ``SWAPS[d]`` of ``operands``, applied one after another."""
    for d in operands:  # one dependent step per operand: where a swap sends the ball depends on where it is
        ball = MOVES[d][ball]
    return ball


def bounce_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1, top_level: int = MAX_DEPTH) -> Episode:
    """v5: v2's fixed-width segments ``__x0x1..xd=SS;`` (d uniform in 0..top_level, operands right-aligned),
    ``SS`` the two-digit result of ``bounce_chain`` (one dependent step per operand after x0) instead of
    the sum. The units digit of ``SS`` has level d, ``;`` level 0; slots, '=', the tens digit unlabelled."""
    width = top_level + 1
    segment_len = width + 4  # slots, '=', two result digits, ';'
    text, levels = [], []
    for _ in range(length // segment_len):
        d = int(rng.integers(0, top_level + 1))
        operands = rng.integers(0, 10, size=d + 1).tolist()
        slots = BLANK * (width - d - 1) + "".join(_DIGITS[x] for x in operands)
        text.extend(f"{slots}={bounce_chain(operands):02d};")
        levels.extend([NO_LABEL] * (width + 2) + [d, 0])
    pad = length - len(text)
    return ("".join(text) + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def bounce_episode_wide(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    """v6: v5's segments with BOUNCE_WIDE_LEVELS + 1 slots (10 segments of 12 bytes per episode)."""
    return bounce_episode(rng, length, top_level=BOUNCE_WIDE_LEVELS)


def shift_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    """v7: ``C:C|`` (C = SHIFT_PREFIX random capitals and their copy, at fixed positions: level 0), ``r`` dots
    (r drawn per episode), ``A|A`` (A = SHIFT_LETTERS distinct lowercase letters, then their copy: level 1),
    dots. The copy of A lies at a fixed distance from A (SHIFT_LETTERS + 1) but at no fixed position: reading it
    by absolute position fails; it is a read relative to the reader's own position."""
    return _copy_episode(rng, length, "shift", SHIFT_MAX_BEFORE, max_gap=0)


def induct_episode(rng: np.random.Generator, length: int = EPISODE_LEN - 1) -> Episode:
    """v8: ``C:C|`` (level 0, as in v7), ``r`` dots, A (SHIFT_LETTERS distinct lowercase letters), ``|``, ``g`` dots
    (1 <= g <= INDUCT_MAX_GAP), A again: level 1 on the copy's letters after its first (which follows the dots, so
    no reading predicts it). r and g are drawn per episode: the copy has neither a fixed position nor a fixed
    distance from its source."""
    return _copy_episode(rng, length, "induct", INDUCT_MAX_BEFORE, max_gap=INDUCT_MAX_GAP)


def _copy_episode(rng: np.random.Generator, length: int, family: str, max_before: int, max_gap: int) -> Episode:
    """v7/v8's layout; ``max_gap`` 0 draws no gap (v7: the same draws, hence the same bytes, as before v8)."""
    capitals = "".join(_CAPS[i] for i in rng.integers(0, len(_CAPS), SHIFT_PREFIX))
    letters = "".join(_KEYS[i] for i in rng.permutation(len(_KEYS))[:SHIFT_LETTERS])
    before = int(rng.integers(0, max_before + 1))
    gap = int(rng.integers(1, max_gap + 1)) if max_gap else 0
    head = f"{capitals}:{capitals}{SHIFT_SEP}" + "." * before + letters + SHIFT_SEP + "." * gap
    text = head + letters
    levels = [NO_LABEL] * (SHIFT_PREFIX + 1) + [0] * SHIFT_PREFIX + [NO_LABEL] * (len(head) - 2 * SHIFT_PREFIX - 1)
    copy = [COPY_LEVELS - 1] * SHIFT_LETTERS
    levels += [NO_LABEL] + copy[1:] if gap else copy  # after a drawn gap nothing predicts the copy's first letter
    if len(text) > length:
        raise ValueError(f"{family} episodes need up to {len(text)} bytes, got length {length}")
    pad = length - len(text)
    return (text + "." * pad).encode("ascii"), levels + [NO_LABEL] * pad


def bounce(state: int, x: int) -> int:
    """One step: add x, unless the sum would pass BOUNCE_LIMIT; then the distance |state - x|. The order of
    the steps matters (7, 6, 5: 13, then 13 + 5 > 14 reflects to 8; 5, 6, 7: 11, then |11 - 7| = 4), so no
    sum of the operands gives the result, and each input moves it (not a Latin square: a sum most of the time)."""
    total = state + x
    return total if total <= BOUNCE_LIMIT else abs(state - x)


def bounce_chain(operands: List[int]) -> int:
    """x0, then one ``bounce`` per further operand, in order: whether step i adds or reflects depends on
    the state the steps before it left."""
    state = operands[0]
    for x in operands[1:]:
        state = bounce(state, x)
    return state


GENERATORS = {"v1": {"arith": arith_episode, "recall": recall_episode, "text": text_episode},
              "v2": {"arith": arith_episode_v2, "recall": recall_episode, "text": text_episode},
              "v3": {"hops": hops_episode},
              "v4": {"cups": cups_episode},
              "v5": {"bounce": bounce_episode},
              "v6": {"bounce": bounce_episode_wide},
              "v7": {"shift": shift_episode}, "v8": {"induct": induct_episode}}


def version(task: str) -> str:
    """The generator version of a probe dataset name (``probe/arith`` -> v1, ``probe-v2/arith`` -> v2)."""
    return VERSIONS[task.split("/")[0]]


def level_count(task: str) -> int:
    """How many levels (0..N-1) a probe dataset's labels use: the default of ``--callbacks.probe_levels``. v1-v5
    share the layout 0..MAX_DEPTH (recall's and hops' top levels stay empty or sparse in it)."""
    return {"v6": BOUNCE_WIDE_LEVELS + 1, "v7": COPY_LEVELS, "v8": COPY_LEVELS}.get(version(task), MAX_DEPTH + 1)


LEVEL_MEANINGS = {"arith": "additions: level d sums d + 1 operands", "recall": "hops through the table, 0 = counting run", "text": "0 = counting run, 1 = copy",
                  "hops": "dependent lookups", "cups": "swaps applied in order", "bounce": "steps applied in order",
                  "shift": "0 = copy at a fixed position, 1 = copy at a moving one",
                  "induct": "0 = copy at a fixed position, 1 = induction copy"}


def level_meaning(task: Optional[str]) -> str:
    """What a level of the task counts, for figure axes: ``probe-v8/induct`` -> its family's meaning; a mixed
    probe (``probe``, ``probe-v2``: one meaning per family) or any other corpus (a label file's levels are the
    researcher's) -> the plain word."""
    family = (task or "").partition("/")[2]
    return f"difficulty level ({LEVEL_MEANINGS[family]})" if family in LEVEL_MEANINGS else "difficulty level"


@functools.lru_cache(maxsize=1)
def embedded_bytes() -> bytes:
    """The embedded corpus as one byte string, control bytes (the span markers) replaced by spaces."""
    from datamodules.corpora import EmbeddedCorpus

    raw = "\n\n".join(EmbeddedCorpus().documents()).encode("utf-8")
    table = bytes(32 if b in _MARKERS else b for b in range(256))
    return raw.translate(table)


def episode(task: str, index: int) -> Tuple[str, Episode]:
    """(family, episode) number ``index`` of a task: the same bytes in every process."""
    families = TASKS[task]
    rng = np.random.default_rng([DATA_SEED, index])
    family = families[index % len(families)]
    return family, GENERATORS[version(task)][family](rng)


# ---------------------------------------------------------------------------- brute-force solver
def solve_episode(family: str, data: bytes, generator: str = "v1") -> Dict[int, Tuple[int, int]]:
    """{position in ``data``: (expected byte, level)} for every labelled token, from the bytes alone."""
    text = data.decode("latin-1")
    if family == "arith":
        return _solve_arith_v2(text) if generator == "v2" else _solve_arith(text)
    if family == "recall":
        return _solve_recall(text)
    if family == "hops":
        return _solve_hops(text)
    if family == "cups":
        return _solve_cups(text)
    if family == "bounce":
        return _solve_bounce(text, slots=BOUNCE_WIDE_LEVELS + 1 if generator == "v6" else MAX_DEPTH + 1)
    if family == "shift":
        return _solve_shift(text)
    if family == "induct":
        return _solve_induct(text)
    return _solve_text(text)


def _arith_segments(text: str, answer_len: int) -> Iterator[Tuple[int, int, List[int]]]:
    """(first byte, position of '=', operands) of every complete segment ``operands=answer;`` whose answer
    has ``answer_len`` bytes (empty v2 slots are not operands)."""
    start = 0
    while True:
        eq = text.find("=", start)
        end = eq + answer_len + 1  # the ';'
        if eq < 0 or end >= len(text) or text[end] != ";":
            return
        yield start, eq, [int(c) for c in text[start:eq] if c != BLANK]
        start = end + 1


def _solve_arith(text: str) -> Dict[int, Tuple[int, int]]:
    out = {}
    for _, eq, operands in _arith_segments(text, answer_len=1):
        total = 0
        for x in operands:  # one addition per operand after the first
            total = (total + x) % 10
        out[eq + 1] = (ord(_DIGITS[total]), len(operands) - 1)
        out[eq + 2] = (ord(";"), 0)
    return out


def _solve_arith_v2(text: str) -> Dict[int, Tuple[int, int]]:
    out = {}
    for start, eq, operands in _arith_segments(text, answer_len=2):
        total = 0
        for x in operands:  # one addition per operand after the first
            total += x
        if text[eq + 1 : eq + 3] != f"{total:02d}":
            raise ValueError(f"arith v2 segment at {start}: {text[start:eq + 4]!r} does not hold its sum")
        out[eq + 2] = (ord(_DIGITS[total % 10]), len(operands) - 1)
        out[eq + 3] = (ord(";"), 0)
    return out


def _solve_recall(text: str) -> Dict[int, Tuple[int, int]]:
    bar = text.index("|")
    table = {text[i]: text[i + 1] for i in range(0, bar, 2)}
    out, i = {}, bar + 1
    while i < len(text) and text[i] != ".":
        if text[i] == "?":
            value, hops = text[i + 1], 0
            while value in table:  # follow the chain, one hop per lookup
                value, hops = table[value], hops + 1
            out[i + 2] = (ord(value), hops)
            i += 3
            continue
        j = i + 1
        while j < len(text) and text[j] in _CAPS and text[j] == _CAPS[(_CAPS.index(text[j - 1]) + 1) % 26]:
            out[j] = (ord(text[j]), 0)
            j += 1
        i = j
    return out


def _solve_hops(text: str) -> Dict[int, Tuple[int, int]]:
    bar = text.index(BAR)
    if bar != len(_NAMES):
        raise ValueError(f"hops: the memory holds {bar} cells, expected one per name ({len(_NAMES)})")
    bindings = {name: [text[i]] for i, name in enumerate(_NAMES)}
    out = {bar: (ord(BAR), 0)}
    for i in range(bar + 1, len(text) - 1, 2):
        if text[i] == ".":
            break
        digit, lookups = fewest_lookups(bindings, text[i])
        out[i + 1] = (ord(digit), lookups)
    return out


def fewest_lookups(bindings: Dict[str, List[str]], name: str) -> Tuple[str, int]:
    """(digit, lookups): breadth-first over the bindings (a name may have several), the digit reached from
    ``name`` with the fewest lookups, each lookup reading the value of a name the previous one returned."""
    frontier, seen, lookups = {name}, {name}, 0
    while frontier:
        digits = {v for v in frontier if v in _DIGITS}
        if len(digits) > 1:
            raise ValueError(f"hops: {name!r} reaches the digits {sorted(digits)} in {lookups} lookups")
        if digits:
            return digits.pop(), lookups
        frontier = {v for k in frontier for v in bindings.get(k, ())} - seen
        seen |= frontier
        lookups += 1
    raise ValueError(f"hops: no digit is reachable from {name!r}")


def _solve_cups(text: str) -> Dict[int, Tuple[int, int]]:
    """Re-plays every fixed-width query from its bytes: the level is the number of swaps applied."""
    out = {}
    for start in range(0, len(text) - CUPS_SEGMENT + 1, CUPS_SEGMENT):
        segment = text[start : start + CUPS_SEGMENT]
        if segment[0] == ".":
            break
        ball, slots, eq = segment[0], segment[1:-2].lstrip(BLANK), start + CUPS_SEGMENT - 2
        if ball not in _DIGITS[:CUPS] or text[eq] != "=" or not slots or any(c not in _DIGITS for c in slots):
            raise ValueError(f"cups: {segment!r} at {start} is not a query 'start, slots, =, answer'")
        out[eq] = (ord("="), 0)
        out[eq + 1] = (ord(str(shell_game(int(ball), [int(c) for c in slots]))), len(slots))
    return out


def _solve_bounce(text: str, slots: int) -> Dict[int, Tuple[int, int]]:
    """Re-plays every segment step by step from its bytes: the level is the number of steps after x0."""
    out = {}
    for start, eq, operands in _arith_segments(text, answer_len=2):
        if not operands or len(text[start:eq]) != slots:
            raise ValueError(f"bounce: segment at {start}: {text[start:eq + 4]!r} is not {slots} slots, '=', two digits, ';'")
        state = operands[0]
        for x in operands[1:]:  # one dependent step per operand after the first
            state = bounce(state, x)
        if text[eq + 1] != _DIGITS[state // 10]:  # unlabelled, so checked here: the labels cannot catch it
            raise ValueError(f"bounce: segment at {start}: {text[start:eq + 4]!r} does not hold its result {state:02d}")
        out[eq + 2] = (ord(_DIGITS[state % 10]), len(operands) - 1)
        out[eq + 3] = (ord(";"), 0)
    return out


def _solve_shift(text: str) -> Dict[int, Tuple[int, int]]:
    """Level 0: the capitals' copy, at its fixed positions. Level 1: after the second ``|``, the letters of the
    run of distinct lowercase letters that ends at it, in order (found by searching for the run)."""
    out, second, letters = _copy_layout(text, "shift")
    out.update({second + 1 + i: (ord(c), 1) for i, c in enumerate(letters)})
    return out


def _solve_induct(text: str) -> Dict[int, Tuple[int, int]]:
    """Level 0 as in v7. Level 1: past the dots after the second ``|``, each letter of the copy after its first is
    the letter that follows, in the source, the copy's previous letter (searched for in the source: induction)."""
    out, second, source = _copy_layout(text, "induct")
    start = second + 1 + len(text[second + 1:]) - len(text[second + 1:].lstrip("."))
    for i in range(start + 1, start + len(source)):
        previous = source.find(text[i - 1])
        if not 0 <= previous < len(source) - 1:
            raise ValueError(f"induct: the copy's letter {text[i - 1]!r} at {i - 1} has no successor in the source")
        out[i] = (ord(source[previous + 1]), 1)
    return out


def _copy_layout(text: str, family: str) -> Tuple[Dict[int, Tuple[int, int]], int, str]:
    """v7/v8's shared layout: (level-0 answers, position of the second ``|``, the source letters before it)."""
    k = SHIFT_PREFIX
    capitals, colon, copy, sep = text[:k], text[k], text[k + 1 : 2 * k + 1], text[2 * k + 1]
    if colon != ":" or sep != SHIFT_SEP or not all(c in _CAPS for c in capitals + copy):
        raise ValueError(f"{family}: the episode does not open with 'C:C|' (capitals, ':', capitals, '|')")
    second = text.index(SHIFT_SEP, 2 * k + 2)
    letters = text[2 * k + 2 : second].lstrip(".")
    if len(set(letters)) != len(letters) or not all(c in _KEYS for c in letters):
        raise ValueError(f"{family}: the letters before the second '|' are not distinct lowercase: {letters!r}")
    return {k + 1 + i: (ord(capitals[i]), 0) for i in range(k)}, second, letters


def _solve_text(text: str) -> Dict[int, Tuple[int, int]]:
    out = {}
    memo = text[text.index(MEMO) + 1 : text.index(MEMO_END)]
    copy = text.index(COPY)
    for j, ch in enumerate(memo + COPY_END):
        out[copy + 1 + j] = (ord(ch), 1)
    count = text.index(COUNT) + 1
    j = count + 1
    while j < len(text) and text[j] in _DIGITS and int(text[j]) == (int(text[j - 1]) + 1) % 10:
        out[j] = (ord(text[j]), 0)
        j += 1
    return out


# ---------------------------------------------------------------------------- the corpus
def byte_ids(tokenizer) -> np.ndarray:
    """Token id of each byte value 0..255 under the byte-level tokenizer."""
    table = _bytes_to_unicode()
    ids = [tokenizer.tokenizer.token_to_id(table[b]) for b in range(256)]
    if tokenizer.name != "bytes" or any(i is None for i in ids):
        raise DataError(f"data.tokenizer: probe data need the byte-level 'bytes' tokenizer, got {tokenizer.name!r}; drop --tokenizer")
    return np.asarray(ids, dtype=np.int64)


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ProbeCorpus(Corpus):
    """``probe`` / ``probe/<family>``: generated episodes; labels are written beside the token cache."""

    default_tokenizer = "bytes"

    def __init__(self, task: str, max_tokens: Optional[int] = None):
        if task not in TASKS:
            raise DataError(f"data.name: unknown probe {task!r}; valid probes: {', '.join(sorted(TASKS))}")
        self.name = task
        self.task = task
        episodes = DEFAULT_EPISODES if max_tokens is None else max_tokens // EPISODE_LEN
        if episodes < 16:
            raise DataError(f"data.max_tokens: probe data need at least {16 * EPISODE_LEN} tokens, got {max_tokens}")
        self.episodes = episodes

    def documents(self) -> Iterator[str]:  # the bytes tokenizer needs no training text
        return iter(())

    def fingerprint(self) -> str:
        parts = f"{version(self.task)}-{self.task}-E{EPISODE_LEN}-D{MAX_DEPTH}-H{MAX_HOPS}-s{DATA_SEED}-n{self.episodes}"
        if "hops" in TASKS[self.task]:  # v1/v2 names keep their fingerprints (and caches)
            parts += f"-L{HOPS_LEVELS}x{HOPS_PER_LEVEL}-cells"
        if "cups" in TASKS[self.task]:
            parts += f"-C{CUPS}-L{CUPS_LEVELS}x{CUPS_PER_LEVEL}-fixed"
        if "bounce" in TASKS[self.task]:
            parts += f"-B{BOUNCE_LIMIT}"
        if version(self.task) == "v6":
            parts += f"-W{BOUNCE_WIDE_LEVELS + 1}"
        if "shift" in TASKS[self.task]:
            parts += f"-P{SHIFT_PREFIX}-A{SHIFT_LETTERS}"
        if "induct" in TASKS[self.task]:
            parts += f"-P{SHIFT_PREFIX}-A{SHIFT_LETTERS}-G{INDUCT_MAX_GAP}"
        if "text" in TASKS[self.task]:
            parts += "-" + hashlib.sha256(embedded_bytes()).hexdigest()[:12]
        return f"probe-{self.task.replace('/', '-')}-{hashlib.sha256(parts.encode()).hexdigest()[:16]}"

    def generate(self, tokenizer) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, levels, family index) of the whole stream."""
        lookup = byte_ids(tokenizer)
        tokens = np.empty(self.episodes * EPISODE_LEN, dtype=np.int64)
        levels = np.empty(self.episodes * EPISODE_LEN, dtype=np.int8)
        families = np.empty(self.episodes * EPISODE_LEN, dtype=np.int8)
        for i in range(self.episodes):
            family, (data, labels) = episode(self.task, i)
            window = slice(i * EPISODE_LEN, (i + 1) * EPISODE_LEN)
            tokens[window] = np.concatenate([[tokenizer.eot_id], lookup[np.frombuffer(data, dtype=np.uint8)]])
            levels[window] = [NO_LABEL] + labels
            families[window] = FAMILIES.index(family)
        return tokens, levels, families

    def write_tokens(self, tokenizer, folder: pathlib.Path, description: str) -> pathlib.Path:
        """Labels first, then tokens + meta.json (last): a crash leaves no cache that looks complete."""
        from datamodules import token_cache

        tokens, levels, families = self.generate(tokenizer)
        folder.mkdir(parents=True, exist_ok=True)
        token_cache.invalidate(folder)  # a rebuild (corrupt labels): the old meta.json must not vouch for new files
        atomic_npy(folder / "levels.npy", levels)
        atomic_npy(folder / "families.npy", families)
        checksums = {name: _sha256(folder / name) for name in LABEL_FILES}
        chunks = iter([(tokens.astype(token_cache.token_dtype(tokenizer.vocab_size)), self.episodes)])
        return token_cache.write_chunks(chunks, tokenizer, folder, description, extra_meta={"labels_sha256": checksums})

    def cache_is_complete(self, folder: pathlib.Path) -> bool:
        """The labels beside the token cache load, have one entry per token and match the sha256 recorded
        at build time (caches built before checksums were recorded: the first two checks only)."""
        from datamodules import token_cache

        try:
            meta = token_cache.read_meta(folder)
            open_labels(folder, int(meta["num_tokens"]))
        except (DataError, KeyError, TypeError, ValueError, OSError):
            return False
        recorded = meta.get("labels_sha256") or {}
        return all(_sha256(folder / name) == digest for name, digest in recorded.items())


LABEL_FILES = ("levels.npy", "families.npy")


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()




def open_labels(folder: pathlib.Path, num_tokens: int) -> Tuple[np.ndarray, np.ndarray]:
    """(levels, families) memmaps beside a probe token cache, checked against the token count."""
    out = []
    for name in LABEL_FILES:
        path = pathlib.Path(folder) / name
        if not path.is_file():
            raise DataError(f"{path}: probe labels are missing; delete {folder} and run again to regenerate it")
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as err:  # truncated or overwritten
            raise DataError(f"{path}: probe labels are unreadable ({err}); delete {folder} and run again to "
                            "regenerate it") from None
        if array.shape != (num_tokens,):
            raise DataError(f"{path}: {array.shape[0]} labels for {num_tokens} tokens; delete {folder} to regenerate")
        out.append(array)
    return out[0], out[1]


def label_usable(positions: np.ndarray, block_start: int) -> np.ndarray:
    """True where the token's episode began inside the block (the model saw everything the label needs)."""
    return positions - positions % EPISODE_LEN >= block_start


def labelled_blocks(datamodule, count: int, rank: int = 0, world: int = 1):
    """This rank's share of the first ``count`` validation blocks of a probe ``LMDataModule``:
    (tokens (N, T+1) int64, levels (N, T) int64, families (N, T) int64) for the targets; unusable -> -1."""
    corpus = datamodule.corpus
    if not isinstance(corpus, ProbeCorpus):
        raise DataError(f"data.name: probe metrics need a probe dataset (probe, probe/<task>), got {corpus.name!r}")
    dataset = next(iter(datamodule.val_sets.values()))
    T = dataset.block_size
    levels_all, families_all = open_labels(datamodule._folder(corpus), len(dataset.tokens))
    chosen = np.array_split(np.asarray(dataset.indices[:count]), world)[rank]
    tokens, levels, families = [], [], []
    for block in chosen.tolist():
        start = int(block) * T
        tokens.append(np.asarray(dataset.tokens[start : start + T + 1], dtype=np.int64))
        targets = np.arange(start + 1, start + T + 1)
        usable = label_usable(targets, start)
        levels.append(np.where(usable, np.asarray(levels_all[targets], dtype=np.int64), NO_LABEL))
        families.append(np.asarray(families_all[targets], dtype=np.int64))
    shape = (0, T)
    return (np.stack(tokens) if tokens else np.zeros((0, T + 1), np.int64),
            np.stack(levels) if levels else np.zeros(shape, np.int64),
            np.stack(families) if families else np.zeros(shape, np.int64))

