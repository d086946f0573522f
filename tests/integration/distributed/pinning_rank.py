"""One rank of a 2-rank gloo launch: which GPU its vLLM engine's processes would see.

Each rank takes the device the trainer gives it on a GPU node (``cuda:<LOCAL_RANK>``), starts a child
process under ``pinned_to`` as the engine does, and reports the ``CUDA_VISIBLE_DEVICES`` the child
saw; rank 0 writes every rank's answer to the file named by argv[1]."""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from nemo_orchestra.rollout.engines.vllm_memory import pinned_to

CHILD = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', ''))"

if __name__ == "__main__":
    dist.init_process_group("gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    with pinned_to(device):
        seen = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.strip()
    after = os.environ.get("CUDA_VISIBLE_DEVICES")
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, {"rank": dist.get_rank(), "engine_sees": seen, "trainer_keeps": after})
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(answers, f)
    dist.destroy_process_group()
