"""The output layer on the loss's rows only (``megatron.forward.logits_at``) gives the full forward's
logprobs there and the same gradients, tied or untied output rows."""

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.forward import forward_logprobs, loss_rows, packed_forward, scatter_rows, token_logprobs
from nemo_orchestra.megatron.model import build_gpt_model
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train.packing import pack
from tests.helpers import traj

VOCAB = 256


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def setup(request):
    cfg = load_config([f"model.tie_embeddings={request.param}", "model.num_layers=2"])
    info = init_distributed(cfg.parallel, seed=3)
    torch.manual_seed(0)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device)
    g = torch.Generator().manual_seed(1)
    trajs = []
    for n, prompt in ((41, 30), (23, 9), (17, 17)):  # the last one has no loss token
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        trajs.append(traj(ids=ids, mask=[0] * prompt + [1] * (n - prompt)))
    (batch,) = pack(trajs, capacity=128)
    return gpt, batch


def test_logprobs_on_loss_rows_equal_the_full_forward(setup):
    gpt, batch = setup
    full = forward_logprobs(gpt, batch, torch.device("cpu"), temperature=0.7)
    rows = forward_logprobs(gpt, batch, torch.device("cpu"), temperature=0.7, only_loss_tokens=True)
    mask = batch.loss_mask_T > 0
    assert 0 < int(mask.sum()) < batch.num_tokens
    torch.testing.assert_close(rows[mask], full[mask], atol=1e-5, rtol=1e-5)
    assert torch.all(rows[~mask] == 0)


def _grads(gpt, batch, only_rows: bool) -> dict[str, torch.Tensor]:
    gpt.zero_grad(set_to_none=True)
    dev = torch.device("cpu")
    rows = loss_rows(batch, dev) if only_rows else None
    logits = packed_forward(gpt, batch, dev, rows)
    targets = batch.target_ids_T if rows is None else batch.target_ids_T[rows]
    lp = scatter_rows(token_logprobs(logits, targets, 0.7), rows, batch.num_tokens)
    (-(lp * batch.loss_mask_T).sum()).backward()
    return {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}


def test_gradients_on_loss_rows_equal_the_full_forward(setup):
    gpt, batch = setup
    gpt.train()
    full, rows = _grads(gpt, batch, False), _grads(gpt, batch, True)
    assert set(full) == set(rows) and any("output_layer" in n or "embedding" in n for n in full)
    for n in full:
        torch.testing.assert_close(rows[n], full[n], atol=1e-5, rtol=1e-4, msg=n)


def test_with_sequence_parallelism_the_rows_come_from_the_output(setup, monkeypatch):
    """A sequence-parallel output layer gathers its input itself: the rows are then taken from its
    output, with the same logprobs as the input-side selection."""
    from nemo_orchestra.megatron.forward import _output_layer

    gpt, batch = setup
    dev = torch.device("cpu")
    rows = loss_rows(batch, dev)
    with torch.no_grad():
        before = packed_forward(gpt, batch, dev, rows)
        monkeypatch.setattr(_output_layer(gpt), "sequence_parallel", True)
        calls = []
        handle = _output_layer(gpt).register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
        after = packed_forward(gpt, batch, dev, rows)
        handle.remove()
    assert calls == [batch.num_tokens]  # the layer saw every row
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_the_hook_is_gone_after_the_forward(setup):
    gpt, batch = setup
    dev = torch.device("cpu")
    with torch.no_grad():
        assert packed_forward(gpt, batch, dev, loss_rows(batch, dev)).shape[1] == int(batch.loss_mask_T.sum())
        assert packed_forward(gpt, batch, dev).shape[1] == batch.num_tokens


def test_flops_count_the_output_layer_on_the_loss_rows_only():
    """perf/mfu counts the work done: the LM head's FLOPs over the loss's tokens, the body's over all."""
    from nemo_orchestra.train.flops import forward_flops

    cfg = load_config([])
    full = forward_flops(cfg.model, 2176, [300, 200])
    rows = forward_flops(cfg.model, 2176, [300, 200], logit_tokens=120)
    assert full == forward_flops(cfg.model, 2176, [300, 200], logit_tokens=500)
    assert full - rows == 2.0 * 2176 * cfg.model.hidden_size * (500 - 120)


def _rows_seen(gpt, batch, rows) -> dict[str, list[int]]:
    """Rows each module of the first and last layer took in one forward."""
    first, last = gpt.decoder.layers[0], gpt.decoder.layers[-1]
    seen: dict[str, list[int]] = {}
    modules = {
        "first mlp": first.mlp,
        "last qkv": last.self_attention.linear_qkv,
        "last proj": last.self_attention.linear_proj,
        "last mlp": last.mlp,
        "final norm": gpt.decoder.final_layernorm,
    }
    handles = [
        mod.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].shape[0]))
        for name, mod in modules.items()
    ]
    try:
        with torch.no_grad():
            packed_forward(gpt, batch, torch.device("cpu"), rows)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_the_last_layer_runs_past_its_keys_and_values_on_the_loss_rows_only(setup):
    """Keys and values for every token; the last layer's attention output, MLP and the final norm on
    the loss's rows (their logprobs and gradients equal the full forward's: the tests above)."""
    gpt, batch = setup
    T, N = batch.num_tokens, int(batch.loss_mask_T.sum())
    every, loss = [T], [N]
    want = {"first mlp": every, "last qkv": every}
    assert _rows_seen(gpt, batch, loss_rows(batch, torch.device("cpu"))) == {
        **want,
        "last proj": loss,
        "last mlp": loss,
        "final norm": loss,
    }
    assert _rows_seen(gpt, batch, None) == {**want, "last proj": every, "last mlp": every, "final norm": every}
    assert gpt.decoder.layers[-1].self_attention.core_attention.rows_N is None  # reset after the forward


@pytest.mark.parametrize("setting", [("fp8", "hybrid"), ("attention_output_gate", True), ("sequence_parallel", True)])
def test_settings_the_selection_cannot_serve_keep_the_whole_last_layer(setup, monkeypatch, setting):
    """FP8 GEMMs (row counts in multiples of 16), an output gate computed on every row, sequence-sharded
    hidden states: the last layer then takes every row, and only the output layer the loss's rows
    (as with activation recomputation, below)."""
    from nemo_orchestra.megatron.forward import selects_last_layer_rows

    gpt, _ = setup
    assert selects_last_layer_rows(gpt)
    monkeypatch.setattr(gpt.decoder.layers[-1].config, *setting)
    assert not selects_last_layer_rows(gpt)


def test_with_activation_recompute_the_last_layer_takes_every_row():
    """A recomputed layer reruns its forward in the backward, outside the selection: there only the
    output layer takes the rows, and the gradients still equal the full forward's."""
    cfg = load_config(["model.num_layers=2", "parallel.activation_recompute=true"])
    init_distributed(cfg.parallel, seed=3)
    torch.manual_seed(0)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (41,), generator=g).tolist()
    (batch,) = pack([traj(ids=ids, mask=[0] * 30 + [1] * 11)], capacity=64)
    gpt.train()
    seen = _rows_seen(gpt, batch, loss_rows(batch, torch.device("cpu")))
    assert seen["last mlp"] == [41] and seen["final norm"] == [41]
    full, rows = _grads(gpt, batch, False), _grads(gpt, batch, True)
    for n in full:
        torch.testing.assert_close(rows[n], full[n], atol=1e-5, rtol=1e-4, msg=n)


def test_flops_of_the_last_layer_on_the_loss_rows():
    """With ``last_layer_rows`` the last layer's output projection, MLP and attention count those rows:
    every row selected gives the full count; the difference per unselected row is exact."""
    from nemo_orchestra.train.flops import forward_flops

    cfg = load_config([])
    m = cfg.model
    full = forward_flops(m, 2176, [300, 200], prefix_lens=[0, 50])
    every = forward_flops(
        m, 2176, [300, 200], prefix_lens=[0, 50], last_layer_rows=[list(range(300)), list(range(200))]
    )
    assert every == full
    # drop row 299 of sequence 0 (it attended to 300 keys) and row 0 of sequence 1 (1 + 50 prompt keys)
    fewer = forward_flops(
        m, 2176, [300, 200], prefix_lens=[0, 50], last_layer_rows=[list(range(299)), list(range(1, 200))]
    )
    per_row = 2.0 * (m.num_attention_heads * m.head_dim * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size)
    per_pair = 2 * m.num_attention_heads * m.head_dim
    head = 2.0 * 2176 * m.hidden_size
    assert full - fewer == 2 * (per_row + head) + per_pair * (2 * 300 + 2 * 51)


def test_the_trainer_counts_the_rows_its_layout_selects(setup):
    from nemo_orchestra.megatron.forward import selects_last_layer_rows
    from nemo_orchestra.train.flops import sequence_layout

    gpt, batch = setup
    assert selects_last_layer_rows(gpt)
    lens, prefixes, rows = sequence_layout([batch])
    assert lens == [41, 23, 17] and prefixes == [0, 0, 0]
    assert rows == [list(range(29, 40)), list(range(8, 22)), []]


def test_a_pack_without_loss_rows_runs_and_gets_no_gradient(setup):
    """A pack with no loss token (the all-padding pack of a rank without data) goes through the
    same path: no logits, no error, a zero gradient."""
    gpt, _ = setup
    (batch,) = pack([traj(ids=list(range(1, 20)), mask=[0] * 19)], capacity=32)
    gpt.zero_grad(set_to_none=True)
    dev = torch.device("cpu")
    rows = loss_rows(batch, dev)
    assert rows.numel() == 0
    logits = packed_forward(gpt, batch, dev, rows)
    assert logits.shape[1] == 0
    lp = scatter_rows(token_logprobs(logits, batch.target_ids_T[rows], 1.0), rows, batch.num_tokens)
    (-(lp * batch.loss_mask_T).sum()).backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0 for p in gpt.parameters())


def test_one_token_plans_are_rows_and_their_restatement_is_read_where_their_token_is_predicted(setup):
    """A trajectory's one-token plans (``Trajectory.plans``) become rows of the pack, in its loss or not (a copy
    lesson's plan is not): the log-probability of each plan's set, read from the rows' logits at the position
    that predicts the plan token, equals the full forward's log-softmax summed over the set there, in a pack that
    shares a prompt as in one that does not."""
    from nemo_orchestra.train.step import restatement_logprobs

    gpt, _ = setup
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    trajs = []
    for n, trained_from in ((45, 30), (33, 30)):  # the same prompt up to the first plan: shared when asked
        ids = prompt + torch.randint(0, VOCAB, (n - 20,), generator=g).tolist()
        t = traj(ids=ids, mask=[0] * trained_from + [1] * (n - trained_from))
        t.plans = [(21, (3, 9, 40)), (trained_from + 2, (7,))]  # the first outside the loss mask
        trajs.append(t)
    dev = torch.device("cpu")
    for share in (False, True):
        (batch,) = pack(trajs, capacity=256, share_prompts=share)
        assert (batch.prefix_B is not None) == share
        rows = loss_rows(batch, dev, plans=True)
        assert set(batch.plan_rows_P.tolist()) <= set(rows.tolist()) and len(loss_rows(batch, dev)) < len(rows)
        assert batch.plan_ids_PB.shape == (4, 3)
        assert all(batch.loss_mask_T[r] == 0 for r in batch.plan_rows_P[::2])
        with torch.no_grad():
            got = restatement_logprobs(packed_forward(gpt, batch, dev, rows), batch, rows, 0.7)
            full = torch.log_softmax(packed_forward(gpt, batch, dev, None)[0].float() / 0.7, -1)
        planned = sorted(t.token_ids[k] for t in trajs for k, _ in t.plans)
        assert sorted(batch.target_ids_T[batch.plan_rows_P].tolist()) == planned  # the rows predict the plans
        for r, ids, lp in zip(batch.plan_rows_P.tolist(), batch.plan_ids_PB.tolist(), got):
            want = torch.logsumexp(full[r, [i for i in ids if i >= 0]], -1)
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
