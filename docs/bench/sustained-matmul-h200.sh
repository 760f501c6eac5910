#!/usr/bin/env bash
# Does the H200 hold its bf16 matmul rate under minutes of load? The planner's floor assumes 790 TFLOP/s,
# measured over a few products; stage 2 of a long step runs the same cuBLAS kernels for minutes, slower.
# One cuBLAS product of each shape below, back to back for SECONDS each, its rate per second of wall time
# (CUDA events), while nvidia-smi samples the SM clock, power and the clock-event reasons every 100 ms.
#   bash docs/bench/sustained-matmul-h200.sh OUT [SECONDS]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/sustained}
seconds=${2:-45}
mkdir -p "$out"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 100 > "$out/smi.csv" 2> "$out/smi.err" &
kill_at_exit $!
logged "$out/matmul.txt" "$python" -u - "$seconds" <<'EOF'
import sys
import time

import torch

seconds = float(sys.argv[1])
# (rows, inner, columns): a square product, and Qwen2.5-7B's gate/up and down projections of one 4096-token chunk.
shapes = {"8192^3": (8192, 8192, 8192), "gate/up 4096x3584x18944": (4096, 3584, 18944),
          "down 4096x18944x3584": (4096, 18944, 3584)}
for name, (m, k, n) in shapes.items():
    # Several operand sets so that no product reads what the previous one left in L2.
    sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    result = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * k * n
    for a, b in sets * 5:
        torch.matmul(a, b, out=result)
    torch.cuda.synchronize()
    print(f"{name}: wall_s, products, TFLOP/s per second of load", flush=True)
    start = time.time()
    while time.time() - start < seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        count = 0
        # About one second of products per window, queued without host waits inside the window.
        while count < 1000:
            a, b = sets[count % 4]
            torch.matmul(a, b, out=result)
            count += 1
        end.record()
        end.synchronize()
        ms = begin.elapsed_time(end)
        print(f"  {time.time():.2f} {count} {flops * count / ms / 1e9:.1f}", flush=True)
    del sets, result
    torch.cuda.empty_cache()
    time.sleep(5)  # each shape starts from a rested card
EOF
touch "$out/done"
