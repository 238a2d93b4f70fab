"""A decode step's launches, counted on the meta device (engines/kernels/launches.py,
engines/reference/step_plan.py): the fused step makes at most 10 per layer of an 8B-shaped Llama
for the formats whose decode steps are captured (the round-3 GPU review counted ~31 a layer,
about 1,000 a step), and the ledger counts what a worked example says it should."""

import dataclasses

import pytest
import torch
from engines.kernels import launches
from engines.reference.model import ModelArgs
from engines.reference.step_plan import plan_decode_step

LLAMA_8B = ModelArgs(model_type="llama", vocab_size=128256, dim=4096, n_layers=2, n_heads=32, n_kv_heads=8,
                     head_dim=128, intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
                     tie_embeddings=False, attention_bias=False, rope_scaling={"rope_type": "default"})

# per layer: add+RMSNorm ×2, the four matmuls (q/k/v, o, gate/up, down), RoPE with the KV store,
# the attention kernel and its split-K merge, SiLU·mul
FUSED_LAYER = {"add_rms_norm_kernel": 2, "aten.mm": 4, "rope_store_kernel": 1, "merge_kernel": 1, "silu_mul_kernel": 1}


def test_the_ledger_counts_device_work_and_not_views():
    x = torch.ones(4, 8, dtype=torch.float16, device="meta")
    with launches.count() as ledger:
        y = x.float()  # a cast: one launch
        y = y.view(8, 4).t()  # views: none
        z = torch.empty(3, device="meta")  # an allocation: none
        z.zero_()  # a fill: one
        (y @ y.t()).sum()  # a matmul and a reduction: two
        torch.arange(3) + 1  # host arithmetic (CPU tensors): none
    assert ledger.total == 4, ledger.by_name
    assert ledger.by_name == {"aten._to_copy": 1, "aten.zero_": 1, "aten.mm": 1, "aten.sum": 1}


def test_a_triton_launch_on_meta_tensors_is_counted_inside_planning_only():
    class Kernel:
        __name__ = "toy_kernel"

        def __getitem__(self, grid):
            raise AssertionError("a planned launch must not start")

    x = torch.empty(4, device="meta")
    with launches.planning(), launches.count() as ledger:
        launches.run(Kernel(), (1,), x)
    assert ledger.by_name == {"toy_kernel": 1}
    with pytest.raises(RuntimeError, match="planning"):
        launches.run(Kernel(), (1,), x)


# where the format's own kernels take RoPE: TurboQuant's write kernel rotates the keys as it reads
# them and its attention kernel the queries, so its quantize-on-write takes the RoPE launch's place
TURBO_LAYER = {"add_rms_norm_kernel": 2, "aten.mm": 4, "write_kernel": 1, "attention_kernel": 1, "merge_kernel": 1,
               "silu_mul_kernel": 1}


@pytest.mark.parametrize("kv", ["fp16", "fp8", "kivi-2", "kivi-4", "turbo-2", "turbo-3", "turbo-4"])
@pytest.mark.parametrize("batch", [1, 16])
def test_a_fused_decode_step_makes_at_most_10_launches_per_layer(kv, batch):
    plan = plan_decode_step(LLAMA_8B, kv, batch, 1024)
    assert plan.per_layer <= 10, plan.layer_ops
    if kv.startswith("turbo"):
        assert plan.layer_ops == TURBO_LAYER
    else:
        attention = "float_attention_kernel" if kv in ("fp16", "fp8") else "attention_kernel"
        assert plan.layer_ops == {**FUSED_LAYER, attention: 1}


def test_the_count_per_layer_does_not_depend_on_depth_or_context():
    a = plan_decode_step(LLAMA_8B, "fp16", 1, 1024)
    b = plan_decode_step(dataclasses.replace(LLAMA_8B, n_layers=5), "fp16", 1, 4096)
    assert a.per_layer == b.per_layer == 10 and a.once == b.once


def test_the_unfused_step_is_what_the_fusion_removed(monkeypatch):
    # CANARY_FUSED_STEP=off: the same attention kernel, every other operator unfused (the review's profile)
    monkeypatch.setenv("CANARY_FUSED_STEP", "off")
    plan = plan_decode_step(LLAMA_8B, "fp16", 1, 1024)
    assert plan.per_layer == 38, plan.layer_ops
    assert plan.layer_ops["aten.index_copy_"] == 2 and plan.layer_ops["aten.mean"] == 2
    assert plan.layer_ops["float_attention_kernel"] == 1


def test_a_wrong_fused_step_setting_is_named(monkeypatch):
    monkeypatch.setenv("CANARY_FUSED_STEP", "yes")
    with pytest.raises(ValueError, match="CANARY_FUSED_STEP: 'yes' is not one of on, off"):
        plan_decode_step(LLAMA_8B, "fp16", 1, 16)
