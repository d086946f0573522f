"""time/weight_sync_s of the vllm engine, file hand-over against in-memory hand-over, on one model.

The model is Qwen3-shaped with random weights (default: Qwen3-0.6B's shape); the engine is built
once, then each transfer loads the full state ``--repeats`` times (after one warm-up load), and
the median seconds of ``load_weights`` are printed with the weights' size. On CPU the in-memory
path is the shared-memory segment, on CUDA the IPC buckets.

    python -m benchmarks.weight_sync                       # Qwen3-0.6B shape, bf16
    python -m benchmarks.weight_sync --layers 36 --hidden 4096 --heads 32 --kv-heads 8 --ffn 12288  # 8B shape
"""

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from nemo_orchestra.config import load_config
    from nemo_orchestra.megatron.model import DTYPES
    from nemo_orchestra.rollout.engines.vllm import VLLMEngine

    cfg = load_config(
        [
            f"model.num_layers={a.layers}",
            f"model.hidden_size={a.hidden}",
            f"model.num_attention_heads={a.heads}",
            f"model.num_query_groups={a.kv_heads}",
            "model.head_dim=128",
            f"model.ffn_hidden_size={a.ffn}",
            f"model.params_dtype={a.dtype}",
            "model.tie_embeddings=true",
            "model.max_position_embeddings=2048",
        ]
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = random_state(cfg.model, a.vocab, DTYPES[a.dtype], device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = VLLMEngine(
        cfg.model, a.vocab, None, device, state, sync_timeout_s=600, max_model_len=512, kv_cache_bytes=256 * 1024**2
    )
    results = {"device": str(device), "params": sum(t.numel() for t in state.values()), "gb": nbytes / 1e9}
    try:
        for transfer in ("file", "memory"):
            engine.transfer = transfer
            engine.load_weights(state)  # warm-up (first segment, first file)
            seconds = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                engine.load_weights(state)
                seconds.append(time.perf_counter() - t0)
            results[f"time/weight_sync_s[{transfer}]"] = statistics.median(seconds)
    finally:
        engine.close()
    print(json.dumps(results))


def random_state(model, vocab: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    from nemo_orchestra.export.qwen3 import megatron_names

    g = torch.Generator(device="cpu").manual_seed(0)
    h, d = model.hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    shapes = {
        "embedding.word_embeddings.weight": (vocab, h),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (vocab, h),
        "input_layernorm.weight": (h,),
        "linear_qkv.weight": (qkv, h),
        "linear_proj.weight": (h, model.num_attention_heads * d),
        "pre_mlp_layernorm.weight": (h,),
        "linear_fc1.weight": (2 * model.ffn_hidden_size, h),
        "linear_fc2.weight": (h, model.ffn_hidden_size),
        "q_layernorm.weight": (d,),
        "k_layernorm.weight": (d,),
    }
    state = {}
    for name in megatron_names(model):
        shape = shapes.get(name) or shapes[name.rsplit(".", 2)[-2] + ".weight"]
        state[name] = (0.02 * torch.randn(shape, generator=g)).to(dtype).to(device)
    return state


if __name__ == "__main__":
    main()
