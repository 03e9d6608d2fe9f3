"""``probe-v8/induct``: v7's layout with a drawn gap between the source letters' ``|`` and their copy
(datamodules/probe.py). Level 0 is the copy at fixed positions; level 1 the copy, which has neither a fixed
position nor a fixed distance from its source, so the one reading left is by content: find where the copy's
previous letter stood in the source and read the letter after it (induction, two composed attention steps).

The tests pin the layout, that the solver re-derives every label, and what cheaper readings get on level 1: an
absolute position or one fixed distance (under 0.1 each, fitted on the very episodes they score), and the source's
letters read as a bag without their order (exactly H_19 / 19)."""
from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction

import pytest

from datamodules import probe
from tests.conftest import brief_probe_run, probe_texts, solved_level_counts

TASK = "probe-v8/induct"
EPISODES = 400
LETTERS = probe.SHIFT_LETTERS


def _episodes(count=EPISODES):
    return probe_texts(TASK, count)


def _layout(text, levels):
    """(start of the source letters, start of the copy)."""
    copy = levels.index(1) - 1  # the copy's first letter is unlabelled
    source = text.index(text[copy], 2 * probe.SHIFT_PREFIX + 2)
    return source, copy


# ---------------------------------------------------------------------------- generator vs brute force
def test_the_solver_re_derives_every_label():
    seen = solved_level_counts(TASK, EPISODES)
    assert seen == {0: EPISODES * probe.SHIFT_PREFIX, 1: EPISODES * (LETTERS - 1)}


def test_the_solver_catches_a_wrong_letter_and_refuses_a_broken_layout():
    _, (data, levels) = probe.episode(TASK, 0)
    i = levels.index(1) + 5
    wrong = data[:i] + (b"a" if data[i:i + 1] != b"a" else b"b") + data[i + 1:]
    assert probe.solve_episode("induct", wrong, "v8")[i] != (wrong[i], 1)  # what the byte should be
    with pytest.raises(ValueError, match="does not open with"):
        probe.solve_episode("induct", b"x" + data[1:], "v8")
    strayed = data[:i] + b"Z" + data[i + 1:]  # a copy letter that is not in the source
    with pytest.raises(ValueError, match="has no successor in the source"):
        probe.solve_episode("induct", strayed, "v8")


def test_level_1_is_the_sources_successor_of_the_previous_letter_after_a_drawn_gap():
    k = probe.SHIFT_PREFIX
    for text, levels in _episodes():
        assert [i for i, level in enumerate(levels) if level == 0] == list(range(k + 1, 2 * k + 1))
        source, copy = _layout(text, levels)
        assert [i for i, level in enumerate(levels) if level == 1] == list(range(copy + 1, copy + LETTERS))
        letters = text[source:source + LETTERS]
        assert len(set(letters)) == LETTERS and text[source + LETTERS] == "|"
        gap = copy - (source + LETTERS + 1)
        assert 1 <= gap <= probe.INDUCT_MAX_GAP and set(text[source + LETTERS + 1:copy]) == {"."}
        assert text[copy:copy + LETTERS] == letters


# ---------------------------------------------------------------------------- no cheaper reading
def test_neither_the_copys_position_nor_its_distance_from_the_source_is_fixed():
    """Start and distance each spread over 30+ values, the most frequent in under a tenth of the episodes."""
    layouts = [_layout(text, levels) for text, levels in _episodes()]
    starts, distances = Counter(c for _, c in layouts), Counter(c - s for s, c in layouts)
    for spread in (starts, distances):
        assert len(spread) >= 30 and max(spread.values()) < 0.1 * EPISODES


def _best_guess_accuracy(key):
    """Each labelled position's most frequent answer per ``key`` (an upper bound on a reading by that key: fitted
    on the very episodes it scores)."""
    votes = {}
    for text, levels in _episodes():
        for i in (i for i, level in enumerate(levels) if level == 1):
            votes.setdefault(key(text, i), Counter())[text[i]] += 1
    return sum(max(c.values()) for c in votes.values()) / sum(sum(c.values()) for c in votes.values())


def test_the_best_absolute_position_or_fixed_distance_reading_stays_near_chance():
    """By absolute position, or from the byte at any one fixed distance back (the read v7's level 1 allows; the
    guess fitted per byte, so copying it is one of the rules tried): right on under 0.1 of the level-1 letters."""
    assert _best_guess_accuracy(lambda text, i: i) < 0.1
    for distance in range(LETTERS + 2, LETTERS + probe.INDUCT_MAX_GAP + 2):  # every source-to-copy distance
        assert _best_guess_accuracy(lambda text, i: text[i - distance]) < 0.1


def test_the_best_guess_from_the_source_letters_without_their_order():
    """A reader that knows the source's letters but not their order, and the copy so far, can only pick one of the
    letters not yet copied: the k-th labelled letter (k = 1..19) has 20 - k candidates, so the ceiling is
    H_19 / 19 = 0.187 (the source's letters are distinct, pinned above)."""
    exact = sum(Fraction(1, LETTERS - k) for k in range(1, LETTERS)) / (LETTERS - 1)
    assert abs(float(exact) - 0.1867) < 1e-4


# ---------------------------------------------------------------------------- the corpus and the CLI
def test_v8_is_its_own_family_version_and_cache_name():
    assert probe.version(TASK) == "v8" and probe.TASKS[TASK] == ("induct",) and probe.FAMILIES[-1] == "induct"
    assert probe.FAMILIES.index("shift") == 6 and probe.level_count(TASK) == 2
    assert len({probe.ProbeCorpus(task).fingerprint() for task in probe.TASKS}) == len(probe.TASKS)


def test_cli_trains_on_v8_with_its_two_levels_by_default(tmp_path, one_thread):
    report = brief_probe_run(TASK, tmp_path)
    assert (report["n_levels"], report["hard_from"]) == (2, 1)
    assert {int(k) for k in report["families"]["induct"]} == {0, 1}
