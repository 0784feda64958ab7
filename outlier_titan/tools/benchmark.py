"""Benchmarks. Sub-benchmark ``optim``: optimizer step time of OrthoAdam and SOAP relative to AdamW;
``probe``: cost of the outlier probe relative to training; ``step``: the trainer's whole training step against
a minimal plain-PyTorch loop, and OrthoAdam's whole step against AdamW's.

    outlier-titan-benchmark optim [--shapes gpt2_124m,debug] [--tile-sizes 256,64] [--reps 5] [--markdown FILE]
    outlier-titan-benchmark probe [--every 100] [--steps 40] [--probes 8] [--mode full] [--gradients]
                                  [--lowprec-recipe mxfp4]   # the low-precision casts' statistics too
    outlier-titan-benchmark step [--steps 20] [--optimizers adamw,orthoadam]
    outlier-titan-benchmark soap-ab BEFORE_CHECKOUT [--steps 10]   # SOAP before/after in one process
    outlier-titan-benchmark compile-math [--scale gpt2] [--step-pairs 12]   # eager vs compiled element-wise math
    outlier-titan-benchmark muon [--ranks 1,2] [--layers 12] [--reps 3]   # Muon step / AdamW step per layout
    outlier-titan-benchmark attention [--seq-lens 256,512,1024] [--impls auto,explicit]   # per attention variant

``step`` builds the debug-run trainer (world size 1, default batch) once per optimizer in this process, and a
plain copy of its model (same weights, no parallel wrappers) stepped by a loop written here: forward, summed
cross entropy / tokens, backward, torch AdamW (foreach). Trainer steps (loader, micro-batches, grad norm, clip,
optimizer, LR schedule) and plain steps on the same batch run interleaved; medians and their ratios.

``probe`` builds the debug-run trainer in this process (world size 1), times training steps and probe runs
interleaved in one run, and reports the throughput drop at ``observe.every = N``: probe time / (N x step time).
With ``--lowprec-recipe`` it also times the probe that measures a recipe's casts (``observe.lowprec_recipe``) on
the BF16 debug model's block linear maps, and reports what those statistics add.

For each shape set, AdamW (torch, foreach), OrthoAdam and SOAP step the *same* parameter tensors with the
same gradients in one process; repetitions are interleaved (AdamW, OrthoAdam, SOAP, then OrthoAdam, SOAP, AdamW,
...: each rep starts one optimizer later) so that load from other processes on a shared machine hits all alike,
and ratios of medians are reported.
SOAP's time is amortised over its refresh period: with staggered refreshes every step refreshes about
1/f of the tiles, and the reps together cover at least f consecutive steps. The first (warm-up) step of each
optimizer, SOAP's eigh initialisation included, is not timed. Also reported: optimizer state bytes per
parameter (checkpointed state; OrthoAdam's regenerated bases separately) and, for the debug model, the
optimizer step as a share of a whole training step (forward + backward + step).
"""

from __future__ import annotations

import sys

import torch

from outlier_titan import cli
from outlier_titan.tools.benchmarks.attention import run_attention_bench
from outlier_titan.tools.benchmarks.compile_math import run_compile_math
from outlier_titan.tools.benchmarks.muon import run_muon
from outlier_titan.tools.benchmarks.optim import run_optim
from outlier_titan.tools.benchmarks.soap_ab import run_soap_ab
from outlier_titan.tools.benchmarks.training import run_probe, run_step


def main(argv=None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    parser = cli.parser(__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    o = sub.add_parser("optim", help="optimizer step time of OrthoAdam and SOAP relative to AdamW",
                       formatter_class=cli.HelpFormatter)
    o.add_argument("--shapes", default="gpt2_124m,debug", help="comma list of: gpt2_124m, debug")
    o.add_argument("--tile-sizes", default="256,64", help="comma list of optimizer.tile_size values")
    o.add_argument("--basis", default="hadamard", choices=("hadamard", "haar", "haar_kron"), help="OrthoAdam basis")
    o.add_argument("--optimizers", default="adamw,orthoadam,soap",
                   help="comma list (adamw first: the ratios' reference) of adamw, orthoadam, soap, "
                        "orthoadam+compile, soap+compile (element-wise math compiled, as compile.enable does)")
    o.add_argument("--frequency", type=int, default=10, help="SOAP precondition_frequency")
    o.add_argument("--soap-factor-dtype", default="float64", choices=("float64", "float32"),
                   help="dtype of SOAP's factor EMAs")
    o.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    o.add_argument("--steps-per-rep", type=int, default=2, help="timed optimizer steps per repetition")
    o.add_argument("--batch", type=int, default=8, help="debug train-step share: sequences")
    o.add_argument("--seq-len", type=int, default=256, help="debug train-step share: tokens per sequence")
    o.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: stable timings on a shared machine; OpenMP spin-waits under load)")
    o.add_argument("--markdown", default="", help="also write the markdown tables to this file")
    p = sub.add_parser("probe", help="outlier-probe cost relative to training steps (debug model)",
                       formatter_class=cli.HelpFormatter)
    p.add_argument("--every", type=int, default=100, help="observe.every the drop is reported for")
    p.add_argument("--steps", type=int, default=40, help="timed training steps")
    p.add_argument("--probes", type=int, default=8, help="timed probe runs, interleaved with the steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps first")
    p.add_argument("--mode", default="full", choices=("full", "cheap"), help="observe.mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--gradients", action="store_true",
                   help="also time the probe with observe.gradients (its backward), interleaved with the one without")
    p.add_argument("--lowprec-recipe", default="",
                   help="also time the probe measuring this recipe's casts (observe.lowprec_recipe), interleaved")
    st = sub.add_parser("step", help="trainer step vs a plain PyTorch loop; OrthoAdam vs AdamW whole steps",
                        formatter_class=cli.HelpFormatter)
    st.add_argument("--steps", type=int, default=20, help="timed steps per loop (interleaved)")
    st.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    st.add_argument("--optimizers", default="adamw,orthoadam", help="comma list of trainer optimizer.name values")
    st.add_argument("--threads", type=int, default=1, help="torch threads")
    ab = sub.add_parser("soap-ab", help="SOAP of another checkout vs this one, with AdamW, in one process",
                        formatter_class=cli.HelpFormatter)
    ab.add_argument("before", help="root of the other checkout (e.g. a git worktree of the base commit)")
    ab.add_argument("--steps", type=int, default=10, help="timed steps per optimizer (interleaved)")
    ab.add_argument("--threads", type=int, default=1, help="torch threads")
    cm = sub.add_parser("compile-math", help="eager vs torch.compile of the optimizers' element-wise math",
                        formatter_class=cli.HelpFormatter)
    cm.add_argument("--scale", default="gpt2", choices=("gpt2", "layer"),
                    help="GPT-2 small's rotated matrices, or one layer's")
    cm.add_argument("--reps", type=int, default=7, help="interleaved timed calls")
    cm.add_argument("--threads", type=int, default=1, help="torch threads")
    cm.add_argument("--step-pairs", type=int, default=12,
                    help="ABBA pairs of whole OrthoAdam steps, eager and compiled (0: skip)")
    mu = sub.add_parser("muon", help="Muon step / AdamW step at GPT-2 small shapes per muon_layout, 1 and 2 ranks",
                        formatter_class=cli.HelpFormatter)
    mu.add_argument("--ranks", default="1,2", help="comma list of gloo world sizes (FSDP-style Shard placements)")
    mu.add_argument("--layers", type=int, default=12, help="GPT-2 small blocks (12: the whole model)")
    mu.add_argument("--layouts", default="full,block,block_periodic", help="comma list of muon_layout values")
    mu.add_argument("--full-every", type=int, default=5, help="block_periodic: muon_full_every")
    mu.add_argument("--tile-size", type=int, default=256, help="block: optimizer.tile_size")
    mu.add_argument("--ns-dtype", default="bfloat16", choices=("bfloat16", "float32", "float64"),
                    help="optimizer.muon_ns_dtype")
    mu.add_argument("--reps", type=int, default=3, help="interleaved timed repetitions")
    mu.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    at = sub.add_parser("attention", help="attention fwd+bwd time, peak memory and kernel per variant and length",
                        formatter_class=cli.HelpFormatter)
    at.add_argument("--variants", default="", help="comma list (default: every registered variant; softmax always)")
    at.add_argument("--impls", default="auto,explicit", help="comma list of model.attention_impl values")
    at.add_argument("--seq-lens", default="256,512,1024", help="comma list of sequence lengths (GPU: 512,...,4096)")
    at.add_argument("--batch", type=int, default=2, help="sequences")
    at.add_argument("--heads", type=int, default=4, help="attention heads")
    at.add_argument("--head-dim", type=int, default=64, help="head dimension")
    at.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"), help="q, k, v dtype")
    at.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    at.add_argument("--reps", type=int, default=5, help="interleaved timed repetitions")
    at.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    command = "outlier-titan-benchmark " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    runs = {"optim": run_optim, "probe": run_probe, "step": run_step, "soap-ab": run_soap_ab,
            "compile-math": run_compile_math, "muon": run_muon, "attention": run_attention_bench}
    runs[args.bench](args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
