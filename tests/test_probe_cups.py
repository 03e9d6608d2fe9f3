"""``probe-v4/cups``: state tracking (the shell game) whose level is the number of dependent swaps
(datamodules/probe.py)."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from datamodules import probe
from tests.conftest import solved_level_counts

TASK = "probe-v4/cups"
EPISODES = 400  # 6,400 queries, 1,600 per level
LEVELS = range(1, probe.CUPS_LEVELS + 1)


def _queries(count=EPISODES):
    """(level, start, operands, answer) of every query of the first ``count`` episodes, read by position."""
    for index in range(count):
        family, (data, levels) = probe.episode(TASK, index)
        text = data.decode("ascii")
        assert family == "cups" and len(text) == len(levels) == probe.EPISODE_LEN - 1
        for start in range(0, probe.CUPS_SEGMENT * probe.CUPS_LEVELS * probe.CUPS_PER_LEVEL, probe.CUPS_SEGMENT):
            segment = text[start : start + probe.CUPS_SEGMENT]
            operands = [int(c) for c in segment[1:-2] if c != probe.BLANK]
            yield levels[start + probe.CUPS_SEGMENT - 1], int(segment[0]), operands, int(segment[-1])


def _play(start, operands):
    """The naive reference: the cups as a list, the two named cups' contents exchanged per operand."""
    cups = [c == start for c in range(probe.CUPS)]
    for d in operands:
        i, j = probe.SWAPS[d]
        cups[i], cups[j] = cups[j], cups[i]
    return cups.index(True)


# ---------------------------------------------------------------------------- generator vs brute force
def test_the_solver_re_derives_every_label_from_the_bytes():
    seen = solved_level_counts(TASK, EPISODES)
    queries = probe.CUPS_LEVELS * probe.CUPS_PER_LEVEL * EPISODES
    assert seen == {0: queries, **{k: probe.CUPS_PER_LEVEL * EPISODES for k in LEVELS}}


def test_answers_follow_the_naive_game_and_the_level_is_the_number_of_swaps():
    for level, start, operands, answer in _queries():
        assert level == len(operands) and answer == _play(start, operands)


def test_the_solver_catches_a_wrong_answer_and_refuses_a_broken_layout():
    family, (data, levels) = probe.episode(TASK, 5)
    answer = levels.index(probe.CUPS_LEVELS)
    wrong = bytearray(data)
    wrong[answer] = ord("0") + (data[answer] - ord("0") + 1) % probe.CUPS
    assert probe.solve_episode(family, bytes(wrong), "v4")[answer] == (data[answer], probe.CUPS_LEVELS)
    with pytest.raises(ValueError, match="is not a query"):
        probe.solve_episode(family, data[1:], "v4")  # every query shifted by one byte


# ---------------------------------------------------------------------------- every step is needed
@pytest.mark.parametrize("k", LEVELS)
def test_no_input_can_be_left_out_the_answer_then_takes_every_cup(k):
    """Exhaustively, over all CUPS x 10^k queries of level k: leaving the start or any one operand free
    lets the answer be every cup, so no k of the k + 1 inputs determine it (the fewest operands that do is
    k, the level); and each level's answer is exactly uniform (chance 1 / CUPS)."""
    answers = Counter()
    for start, *operands in itertools.product(range(probe.CUPS), *[range(len(probe.SWAPS))] * k):
        answers[probe.shell_game(start, operands)] += 1
        assert {probe.shell_game(s, operands) for s in range(probe.CUPS)} == set(range(probe.CUPS))
        for j in range(k) if start == operands[0] % probe.CUPS else ():  # a fifth of the queries: fast enough
            free = {probe.shell_game(start, operands[:j] + [d] + operands[j + 1 :]) for d in range(len(probe.SWAPS))}
            assert free == set(range(probe.CUPS)), (start, operands, j)
    assert set(answers.values()) == {len(probe.SWAPS) ** k}


def test_guesses_that_skip_steps_or_the_order_stay_below_the_solution():
    """Accuracy of guesses that follow fewer steps (start, first or last swap only) or ignore the order
    (the swaps reversed): measured per level, pinned here, all far below 1 at levels 3-4."""
    rules = {"copy start": lambda s, ops: s, "last swap only": lambda s, ops: probe.shell_game(s, ops[-1:]),
             "first swap only": lambda s, ops: probe.shell_game(s, ops[:1]),
             "reversed order": lambda s, ops: probe.shell_game(s, ops[::-1])}
    hits, total = Counter(), Counter()
    for level, start, operands, answer in _queries():
        total[level] += 1
        for name, rule in rules.items():
            hits[name, level] += rule(start, operands) == answer
    accuracy = {(name, k): hits[name, k] / total[k] for name in rules for k in LEVELS}
    exact = {"copy start": (0.6, 0.4, 0.3, 0.25), "last swap only": (1.0, 0.6, 0.4, 0.3),
             "first swap only": (1.0, 0.6, 0.4, 0.3), "reversed order": (1.0, 0.64, 0.508, 0.452)}
    for (name, k), value in accuracy.items():  # the exact expectations (computed over all inputs) +- 4 s.e.
        assert value == pytest.approx(exact[name][k - 1], abs=0.05), (name, k, value)


def test_answers_are_uniform_per_level_in_the_data():
    answers = {k: Counter() for k in LEVELS}
    for level, _, _, answer in _queries():
        answers[level][answer] += 1
    for counts in answers.values():  # 1,600 answers per level: 320 +- 16 per cup
        assert set(counts) == set(range(probe.CUPS)) and max(counts.values()) / sum(counts.values()) < 0.24


def test_levels_are_shuffled_and_the_layout_is_fixed():
    orders = set()
    for index in range(20):
        _, (data, levels) = probe.episode(TASK, index)
        answers = levels[probe.CUPS_SEGMENT - 1 :: probe.CUPS_SEGMENT][: probe.CUPS_LEVELS * probe.CUPS_PER_LEVEL]
        assert sorted(answers) == sorted(list(LEVELS) * probe.CUPS_PER_LEVEL)
        assert all(data[i] == ord("=") for i in range(probe.CUPS_SEGMENT - 2, len(answers) * probe.CUPS_SEGMENT,
                                                      probe.CUPS_SEGMENT))
        orders.add(tuple(answers))
    assert len(orders) == 20


# ---------------------------------------------------------------------------- the corpus and the CLI
def test_v4_is_its_own_family_and_version():
    assert probe.FAMILIES.index("cups") == 4 and probe.version(TASK) == "v4" and probe.TASKS[TASK] == ("cups",)


def test_cli_trains_on_cups_and_logs_every_level(tmp_path, one_thread):
    from experiments.run import main
    from tests.conftest import TINY_RUN

    run_dir = main(["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
                    str(tmp_path / "c"), "--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path),
                    *TINY_RUN, "--model.block_size", "128", "--callbacks.probe_blocks", "4"])
    cups = json.loads((run_dir / "probe.json").read_text())["families"]["cups"]
    queries = cups["0"]["tokens"]  # one '=' per query of the whole episodes in the evaluated blocks
    assert queries >= 16 and all(cups[str(k)]["tokens"] * probe.CUPS_LEVELS == queries for k in LEVELS)


def test_the_best_order_blind_guess_is_exact_below_1_from_level_2():
    """Exhaustively: the Bayes-optimal guess from the start and the multiset of the swaps (their order
    ignored) scores 1, 0.82, 0.678, 0.5626 at levels 1-4: the ceiling of any reader that sees which swaps
    were made but not in what order (a model above it at a level uses the order)."""
    ceiling = {}
    for k in LEVELS:
        outcomes = {}
        for start, *operands in itertools.product(range(probe.CUPS), *[range(len(probe.SWAPS))] * k):
            outcomes.setdefault((start, tuple(sorted(operands))), Counter())[probe.shell_game(start, operands)] += 1
        ceiling[k] = sum(max(c.values()) for c in outcomes.values()) / (probe.CUPS * len(probe.SWAPS) ** k)
    assert ceiling == pytest.approx({1: 1.0, 2: 0.82, 3: 0.678, 4: 0.5626}, abs=5e-4)
