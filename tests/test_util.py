"""relex.util: the small helpers that several parts of relex share."""

import pytest
import torch

from relex.errors import RelexError
from relex.util import comma_list, grouped, is_int, is_positive_int, module_type, most_common_float_dtype, read_log


def test_comma_list_strips_and_drops_empty_parts():
    assert comma_list(" relex, two-point,,") == ["relex", "two-point"]
    assert comma_list(None) == [] and comma_list("") == []


@pytest.mark.parametrize("value, integer, positive", [(3, True, True), (0, True, False), (-1, True, False), (True, False, False), (2.0, False, False), ("3", False, False)])
def test_integer_checks_refuse_bools_and_floats(value, integer, positive):
    assert is_int(value) is integer and is_positive_int(value) is positive


def test_module_types_group_tensors_across_layers():
    assert module_type("model.layers.7.mlp.up_proj.weight") == "mlp.up_proj.weight"
    assert module_type("lm_head.weight") == "lm_head.weight"
    names = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    assert grouped((module_type(n), i) for i, n in enumerate(names)) == {"mlp.up_proj.weight": [0, 2], "model.norm.weight": [1]}


def test_most_common_float_dtype_ignores_integers_and_keeps_the_first_on_a_tie():
    dtypes = [torch.int64, torch.int64, torch.int64, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    assert most_common_float_dtype(dtypes) == torch.bfloat16
    assert most_common_float_dtype([torch.int64]) is None


def test_read_log_takes_the_run_or_the_file_and_names_a_bad_line(tmp_path):
    assert read_log(tmp_path) == []
    (tmp_path / "log.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    assert read_log(tmp_path) == read_log(tmp_path / "log.jsonl") == [{"step": 1}, {"step": 2}]
    (tmp_path / "log.jsonl").write_text('{"step": 1}\n{"step": 2, "rew\n')
    with pytest.raises(RelexError, match="log.jsonl, line 2: not JSON"):
        read_log(tmp_path)
