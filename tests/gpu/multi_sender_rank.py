"""One trainer rank of a multi-sender GPU weight update, as its own process
(tests/gpu/test_vllm_multi_sender.py):

    python -m tests.gpu.multi_sender_rank ADDRESS UPDATE_ID RANK RANKS MODEL_DIR TRANSPORT [--vanish]

Loads MODEL_DIR on cuda:0, keeps the parameters i with i % RANKS == RANK (a
rank holding part of the model, as an FSDP / pipeline rank would), joins the
update as sender RANK and sends them. Prints "SENT <json>" when its part is
in; over cuda_ipc it then keeps its buckets until the coordinator's commit
round is over (the `with` exit) and prints "RELEASED". --vanish: exits
without sending (a rank that died). The update's sender secret comes in
$RB_SENDER_SECRET (the coordinator's `upd.sender_secret`; not argv, which
other local users can read).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    address, update_id, rank, ranks, model_dir, transport = argv[:6]
    rank_i, ranks_i = int(rank), int(ranks)
    if "--vanish" in argv:
        print("VANISHED", flush=True)
        os._exit(3)
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge import Client

    torch.cuda.set_device(0)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
    mine = [(n, t) for i, (n, t) in enumerate(m.named_parameters()) if i % ranks_i == rank_i]
    c = Client(address, timeout_s=120, control_timeout_s=120)
    try:
        secret = os.environ["RB_SENDER_SECRET"]
        with c.weight_sender(update_id, rank_i, device="cuda:0", sender_secret=secret) as s:
            stats = s.send(mine)
            print("SENT " + json.dumps(stats), flush=True)
        print("RELEASED", flush=True)
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
