"""The per-family table (`tidal.models.families`): every cell names a test that exists, every architecture the
tests build has its family's row, the packing rule follows the layers, and `tidal grpo --dry-run` prints the row."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.archs import ARCHS, build, config_for
from tidal.models.families import COLUMNS, FAMILIES, ONE_PER_ROW, PACKED, describe, family_of, packing_rule

REPO = Path(__file__).resolve().parents[2]


def parametrize_ids(fn: ast.FunctionDef) -> set[str] | None:
    """The literal ids of `fn`'s parametrizations we can read (None: parametrized over `ARCHS`, computed or through
    a fixture: the matrix's `served`)."""
    ids: set[str] = set()
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize":
            values = dec.args[1]
            if not isinstance(values, ast.List | ast.Tuple):
                return None
            for v in values.elts:
                if isinstance(v, ast.Constant):
                    ids.add(str(v.value))
                elif isinstance(v, ast.Call) and v.args and isinstance(v.args[0], ast.Constant):
                    ids.add(str(v.args[0].value))
    return ids or None


def test_every_cell_names_a_test_that_exists():
    named = 0
    for fam in FAMILIES:
        assert tuple(fam.cells) == COLUMNS, fam.name
        for col, cell in fam.cells.items():
            if cell.test == "-":
                assert not cell.value.startswith("yes"), f"{fam.name} {col}: a claim without a test"
                continue
            path, _, rest = cell.test.partition("::")
            name, _, param = rest.partition("[")
            tree = ast.parse((REPO / path).read_text())
            fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
            assert fns, f"{fam.name} {col}: {cell.test} does not exist"
            if param:
                ids = parametrize_ids(fns[0])
                assert param[:-1] in (set(ARCHS) if ids is None else ids) or (path.endswith("test_arch_matrix.py")
                                                                              and param[:-1] in ARCHS), cell.test
            named += 1
    assert named > 7 * len(FAMILIES)  # (the Gemma 4 VLM row claims less: its serving is open)


@pytest.mark.parametrize("name", list(ARCHS))
def test_every_tested_architecture_has_its_row(name):
    config = config_for(name)
    fam = family_of(config)
    assert fam is not None and fam.arch == name
    assert family_of(config.to_dict()) is fam  # a config.json dict reads the same
    assert packing_rule(config) == (ONE_PER_ROW if name.startswith("qwen3.5") else PACKED)


def test_packing_rule_reads_the_layers_and_vlm_text_configs():
    assert packing_rule({"model_type": "x", "layer_types": ["linear_attention", "full_attention"]}) == ONE_PER_ROW
    assert packing_rule({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}) == ONE_PER_ROW
    assert packing_rule({"model_type": "x", "text_config": {"layer_types": ["linear_attention"]}}) == ONE_PER_ROW
    assert packing_rule({"model_type": "gemma3_text", "layer_types": ["sliding_attention"]}) == PACKED
    assert family_of({"model_type": "nobody"}) is None
    assert "not in tidal's tested matrix" in describe({"model_type": "nobody"})


def test_grpo_dry_run_prints_the_models_row(tmp_path):
    model = build("qwen3.5", tmp_path / "model")
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--model", str(model),
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "# model family: Qwen3.5" in r.stdout and f"#   packing: {ONE_PER_ROW}" in r.stdout
    assert "test_packed_logprobs_equal_one_sample_per_row" in r.stdout
    assert not (tmp_path / "run").exists()
