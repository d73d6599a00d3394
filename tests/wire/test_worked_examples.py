"""docs/topology.md#worked-examples against vllm_afd.wire.topology: every column of the table holds.

The table names, per layout, its data subgroups and control pairs, the splits (attention DPxTP on FFN DPxTP)
that run end to end and the splits the layout rule refuses.  Each refused split must raise the layout rule's
message naming the split; every other split of the layout's rank counts must pass.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from vllm_afd.wire.errors import AFDLayoutError
from vllm_afd.wire.topology import check_layout, data_subgroup

TOPOLOGY_MD = Path(__file__).resolve().parents[2] / "docs" / "topology.md"
SPLIT = re.compile(r"(\d)×(\d) on (\d)×(\d)")
EXPECTED_LAYOUTS = ["1A1F", "2A1F", "2A2F", "3A2F", "4A2F"]


def worked_examples() -> dict[str, list[str]]:
    """Layout name -> its row's cells, from the table under "## Worked examples"."""
    section = TOPOLOGY_MD.read_text().split("## Worked examples", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if re.fullmatch(r"\d+A\d+F", cells[0]):
            table[cells[0]] = cells
    return table


TABLE = worked_examples()


def sizes(layout: str) -> tuple[int, int]:
    num_attention, num_ffn = re.fullmatch(r"(\d+)A(\d+)F", layout).groups()
    return int(num_attention), int(num_ffn)


def splits(cell: str) -> set[tuple[tuple[int, int], tuple[int, int]]]:
    return {((int(a), int(b)), (int(c), int(d))) for a, b, c, d in SPLIT.findall(cell)}


def every_split(num_attention: int, num_ffn: int) -> set[tuple[tuple[int, int], tuple[int, int]]]:
    def factorings(n):
        return [(dp, n // dp) for dp in range(1, n + 1) if n % dp == 0]

    return set(itertools.product(factorings(num_attention), factorings(num_ffn)))


def test_the_table_names_the_five_layouts():
    assert list(TABLE) == EXPECTED_LAYOUTS


@pytest.mark.parametrize("layout", EXPECTED_LAYOUTS)
def test_the_data_subgroups_and_control_pairs_are_the_topologys(layout):
    num_attention, num_ffn = sizes(layout)
    _, groups, control, *_ = TABLE[layout]

    def name(afd_rank):
        return f"F{afd_rank}" if afd_rank < num_ffn else f"A{afd_rank - num_ffn}"

    expected_groups = ", ".join(f"({', '.join(name(r) for r in data_subgroup(k, num_attention, num_ffn))})"
                                for k in range(num_ffn))
    pairs = re.split(r"[,;] ", control)
    assert groups == expected_groups
    assert [p for p in pairs if "→" in p] == [f"A{k} → F{k}" for k in range(num_ffn)]
    assert {p for p in pairs if "→" not in p} <= {f"A{j} none" for j in range(num_ffn, num_attention)}


@pytest.mark.parametrize("layout", EXPECTED_LAYOUTS)
def test_the_splits_that_run_pass_the_layout_rule_and_name_a_test(layout):
    num_attention, num_ffn = sizes(layout)
    runs = TABLE[layout][3]

    assert splits(runs), f"{layout}: no split named as running"
    assert re.search(r"`tests/[\w/]+\.py", runs), f"{layout}: no test cited"
    for (attention, ffn) in splits(runs):
        check_layout(*attention, *ffn, num_attention, num_ffn)


@pytest.mark.parametrize("layout", EXPECTED_LAYOUTS)
def test_exactly_the_refused_splits_are_refused_naming_the_split(layout):
    num_attention, num_ffn = sizes(layout)
    refused = splits(TABLE[layout][4])

    for attention, ffn in sorted(every_split(num_attention, num_ffn)):
        if (attention, ffn) not in refused:
            check_layout(*attention, *ffn, num_attention, num_ffn)
            continue
        with pytest.raises(AFDLayoutError) as info:
            check_layout(*attention, *ffn, num_attention, num_ffn)
        assert str(info.value) == (
            "AFD layout invalid: the TP peers of FFN DP rank 0 would receive different tokens "
            f"(attention DPxTP = {attention[0]}x{attention[1]}, FFN DPxTP = {ffn[0]}x{ffn[1]}); "
            "use the same DP and TP on both roles, or FFN TP = 1"
        )
