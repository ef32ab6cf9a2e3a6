"""Gradient head importance, the plan it writes, the KV-head masks and `preempt importance`
(all on small random models: the trained LM's numbers are a benchmark, docs/lm.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from preempt.cli import main
from preempt.kernels.plan import HeadClass, HeadPlan
from preempt.lm import forward_batch
from preempt.lm.corpus import CorpusConfig
from preempt.lm.importance import (
    gates_for_dropped,
    head_importance,
    kv_head_scores,
    masking_comparison,
    normalise_per_layer,
    scores_path,
)
from preempt.model.checkpoint import save_tiny_lm
from preempt.model.tiny import TinyConfig, TinyLM
from tests.lm import TEST_CONFIG, write_corpus

torch.set_num_threads(1)


def _windows(num=6, length=17, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num, length), generator=gen).numpy()


def test_importance_is_deterministic_and_positive():
    model = TinyLM(TEST_CONFIG, seed=2)
    first = head_importance(model, _windows(), batch_size=4)
    assert first.shape == (TEST_CONFIG.num_layers, TEST_CONFIG.num_heads)
    assert torch.equal(first, head_importance(model, _windows(), batch_size=4))
    assert (first > 0).all()
    assert not torch.equal(first, head_importance(model, _windows(seed=1), batch_size=4))


def test_importance_is_mean_of_per_window_abs_gradients():
    model = TinyLM(TEST_CONFIG, seed=2, dtype=torch.float64)
    windows = _windows(num=3)
    cfg = TEST_CONFIG
    expected = torch.zeros(cfg.num_layers, cfg.num_heads, dtype=torch.float64)
    for window in torch.as_tensor(windows):
        xi = torch.ones(cfg.num_layers, cfg.num_heads, dtype=torch.float64, requires_grad=True)
        loss = torch.nn.functional.cross_entropy(model.forward_naive(window[:-1], xi), window[1:])
        expected += torch.autograd.grad(loss, xi)[0].abs()
    torch.testing.assert_close(head_importance(model, windows, batch_size=2), expected / 3)


def test_normalise_and_kv_reduction():
    scores = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    normed = normalise_per_layer(scores)
    torch.testing.assert_close(normed[0], torch.tensor([0.6, 0.8, 0.0, 0.0]))
    assert torch.equal(normed[1], scores[1])  # an all-zero layer stays zero, no NaN
    torch.testing.assert_close(kv_head_scores(normed, 2), torch.tensor([[1.4, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="do not split"):
        kv_head_scores(normed, 3)


def test_mask_gates_exactly_the_chosen_kv_heads_query_heads():
    dropped = np.array([[False, True], [True, False], [False, False]])
    gates = gates_for_dropped(dropped, num_heads=6)  # 3 query heads per KV head
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(gates, expected)


def test_a_masked_kv_head_no_longer_influences_the_output():
    model = TinyLM(TEST_CONFIG, seed=4, dtype=torch.float64)
    dropped = np.zeros((TEST_CONFIG.num_layers, TEST_CONFIG.num_kv_heads), dtype=bool)
    dropped[1, 0] = True
    gates = gates_for_dropped(dropped, TEST_CONFIG.num_heads).double()
    ids = torch.as_tensor(_windows(num=2))
    before = forward_batch(model, ids, gates)
    with torch.no_grad():  # scramble the masked head's values: nothing may change
        model.layers[1].self_attn.v_proj.weight[: TEST_CONFIG.head_dim] *= -3.0
    torch.testing.assert_close(forward_batch(model, ids, gates), before)
    assert not torch.allclose(forward_batch(model, ids), before)


def test_masking_comparison_orders_and_counts():
    config = TinyConfig(256, 2, 32, 4, 4, 8, 64)
    model = TinyLM(config, seed=5)
    scores = torch.arange(8, dtype=torch.float64).reshape(2, 4)  # layer 0 head 0 least
    report = masking_comparison(model, _windows(num=4), scores, 2, num_random=3, seed=0)
    assert report["least"]["heads"] == [[0, 0], [0, 1]]
    assert report["most"]["heads"] == [[1, 2], [1, 3]]
    assert report["random"]["num_seeds"] == 3 and all(len(m) == 2 for m in report["random"]["masks"])
    assert report["eval_bytes"] == 4 * 16
    again = masking_comparison(model, _windows(num=4), scores, 2, num_random=3, seed=0)
    assert again == report
    with pytest.raises(ValueError, match="num_masked"):
        masking_comparison(model, _windows(num=4), scores, 8)


@pytest.fixture
def checkpoint(tmp_path):
    root = write_corpus(tmp_path / "src", num_files=40)
    corpus = CorpusConfig(root=str(root), val_percent=20, test_percent=20).__dict__
    config = TinyConfig(256, 2, 32, 4, 4, 8, 64)  # 8 KV heads: 10% drops 1
    path = tmp_path / "lm.pt"
    save_tiny_lm(TinyLM(config, seed=1), path, {"train_config": {"seq_len": 32, "corpus": corpus}})
    return path


def test_cli_writes_plan_and_scores(tmp_path, checkpoint, capsys):
    out = tmp_path / "plans" / "importance_plan.json"
    argv = ["importance", "--model", str(checkpoint), "--out", str(out), "--calib-bytes", "660",
            "--eval-bytes", "660", "--num-random", "2", "--seed", "3"]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)  # stdout is one JSON object
    plan = HeadPlan.load(out)
    assert (plan.num_layers, plan.num_kv_heads) == (2, 4)
    assert (plan.num_drop, plan.num_fp8, plan.num_fp16) == (1, 4, 3)
    assert printed["plan"] == plan.to_dict()["layers"] and "michel2019" in plan.source
    scores = json.loads(scores_path(out).read_text())
    assert scores_path(out).name == "importance_plan.scores.json"
    kv = np.array(scores["kv_head_scores"])
    assert kv.shape == (2, 4)
    # The plan is the scores' ranking: the dropped head has the lowest score.
    assert plan.codes().reshape(-1)[np.argmin(kv)] == HeadClass.DROP
    assert HeadPlan.from_importance(kv, fp8_share=0.5, drop_share=0.1).classes == plan.classes
    assert scores["masking"]["least"]["heads"] == [
        [int(i) for i in np.argwhere(plan.dropped_mask().numpy())[0]]
    ]
    assert scores["calibration"] == {"split": "val", "num_windows": 20, "window_bytes": 33, "seed": 3}
    # Same seed, same plan and scores.
    assert main([*argv[:4], str(tmp_path / "again.json"), *argv[5:]]) == 0
    assert HeadPlan.load(tmp_path / "again.json").classes == plan.classes
    assert (
        json.loads(scores_path(tmp_path / "again.json").read_text())["kv_head_scores"]
        == scores["kv_head_scores"]
    )


def test_a_bad_plan_file_is_a_clear_error(tmp_path, checkpoint):
    out = tmp_path / "plan.json"
    argv = ["importance", "--model", str(checkpoint), "--out", str(out), "--calib-bytes", "330",
            "--eval-bytes", "330", "--num-random", "1"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    data["layers"] = data["layers"][:1]
    out.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"head plan file {out}: 'layers' has 1 rows"):
        HeadPlan.load(out)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--drop-share", "1.5"], "drop_share must lie in [0, 1]"),
        (["--fp8-share", "0.95"], "fp8_share + drop_share must be <= 1"),
    ],
)
def test_cli_bad_shares(tmp_path, checkpoint, capsys, extra, message):
    assert main(["importance", "--model", str(checkpoint), "--out", str(tmp_path / "p.json"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_bad_model_and_out(tmp_path, checkpoint, capsys):
    assert main(["importance", "--model", str(tmp_path / "none.pt"), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "none.pt: file not found" in err and len(err.splitlines()) == 1
    assert main(["importance", "--model", str(checkpoint), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["importance", "--out", "p.json"])
    assert info.value.code == 2


def test_random_masks_are_distinct_and_rank_correlation():
    from preempt.lm.importance import _random_masks, rank_correlation

    masks = _random_masks((2, 2), 2, count=10, seed=0)  # only C(4, 2) = 6 exist
    assert len(masks) == 6 and len({m.tobytes() for m in masks}) == 6
    assert all(m.sum() == 2 for m in masks)
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert rank_correlation(a, a * 10) == pytest.approx(1.0)
    assert rank_correlation(a, -a) == pytest.approx(-1.0)


def test_cli_raw_scores_and_single_head_costs(tmp_path, checkpoint, capsys):
    out = tmp_path / "raw.json"
    argv = ["importance", "--model", str(checkpoint), "--out", str(out), "--calib-bytes", "330",
            "--eval-bytes", "330", "--num-random", "1", "--normalize", "none", "--single-head"]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)  # stdout is one JSON object
    report = json.loads(scores_path(out).read_text())
    raw = np.array(report["query_head_raw"]).reshape(2, 4, 1).sum(-1)
    np.testing.assert_allclose(np.array(report["kv_head_scores"]), raw)  # not normalised
    assert "normalize=none" in HeadPlan.load(out).source
    assert np.array(printed["single_head_delta_bpb"]).shape == (2, 4)
    assert -1.0 <= printed["single_head_rank_correlation"] <= 1.0


def test_cli_bad_normalize_exits_2(tmp_path, checkpoint):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "importance",
                "--model",
                str(checkpoint),
                "--out",
                str(tmp_path / "p.json"),
                "--normalize",
                "max",
            ]
        )
    assert info.value.code == 2


def _tiny_lm():
    cfg = TinyConfig(vocab_size=256, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=64)  # fmt: skip
    return TinyLM(cfg, seed=3)


def test_restored_prefix_forward_is_exact_with_the_exact_prefix_and_masks_dropped_heads():
    from preempt.lm.importance import _forward_with_prefix, clean_prefix_kv

    model = _tiny_lm()
    windows = torch.as_tensor(_windows(num=2, length=20))
    with torch.inference_mode():
        full = forward_batch(model, windows)
        clean = clean_prefix_kv(model, windows)[:, :, :, :12]
        torch.testing.assert_close(_forward_with_prefix(model, windows, clean), full)
        masked = np.array([[True, False], [False, False]])
        hidden = _forward_with_prefix(model, windows, clean, masked)
        gates = gates_for_dropped(masked, 4)
        naive = model.forward_naive(windows[0], masked_until=torch.tensor([[12, 0], [0, 0]]))
    torch.testing.assert_close(hidden[0, 12:], naive[12:], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(hidden[0, 12:], full[0, 12:])
    assert gates.shape == (2, 4)


def test_prefix_sensitivity_prices_coarser_classes_higher():
    from preempt.lm.importance import prefix_sensitivity

    scores = prefix_sensitivity(_tiny_lm(), _windows(num=2, length=40), 32, ("fp8", "kivi2"), (8, 0, 0))
    assert scores["fp8"].shape == (2, 2) and (scores["fp8"] >= 0).all()
    assert scores["kivi2"].sum() > scores["fp8"].sum() > 0


def test_plan_for_budget_is_the_exact_knapsack_optimum():
    import itertools

    from preempt.kernels.plan import size_vs_fp16
    from preempt.lm.importance import class_sizes, place_at_random, place_by_rank, plan_for_budget

    rng = np.random.default_rng(0)
    labels = ("fp8", "kivi4", "kivi2")
    scores = {c: rng.random((2, 2)) * w for c, w in zip(labels, (1, 3, 9), strict=True)}
    sizes = class_sizes(labels, 64, 16, (16, 0, 0))
    plan = plan_for_budget(scores, sizes, 0.4, params=(16, 0, 0))
    assert size_vs_fp16(plan, 64, 16) <= 0.4
    table = {"fp16": np.zeros((2, 2)), **scores}
    best = min(
        sum(table[c][divmod(i, 2)] for i, c in enumerate(combo))
        for combo in itertools.product(table, repeat=4)
        if sum({"fp16": 1.0, **sizes}[c] for c in combo) <= 0.4 * 4
    )
    got = sum(
        table[c.label][layer, head] for layer, row in enumerate(plan.classes) for head, c in enumerate(row)
    )
    assert got == pytest.approx(best)
    ranked = place_by_rank(plan, np.arange(4).reshape(2, 2), sizes, "rank")
    shuffled = place_at_random(plan, seed=1)
    for other in (ranked, shuffled):
        assert sorted(other.codes().reshape(-1)) == sorted(plan.codes().reshape(-1))
        assert other.params() == plan.params()
    with pytest.raises(ValueError, match="no plan"):
        plan_for_budget(scores, sizes, 0.01, params=(16, 0, 0))


def test_key_value_split_adds_up_and_refuses_drop():
    from preempt.lm.importance import key_value_split

    model, windows = _tiny_lm(), _windows(num=2, length=40)
    split = key_value_split(model, windows, 32, ("kivi2",), (8, 0, 0))["kivi2"]
    assert split["keys"] > 0 and split["values"] > 0  # each half alone moves the output
    assert split["both"] > max(split["keys"], split["values"])  # and together more than either
    with pytest.raises(ValueError, match="drop"):
        key_value_split(model, windows, 32, ("drop",), (8, 0, 0))
