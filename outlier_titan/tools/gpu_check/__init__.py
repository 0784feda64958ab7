"""The GPU check: an environment report, the ``gpu``-marked tests and the GPU benchmarks, in four parts that
each fit one 10-minute device call; ``--dry`` runs the same code paths on tiny shapes on the CPU.

    python -m outlier_titan.tools.gpu_check --part 1|2|3|4|2,3,4|all [--dry] [--out DIR] [--budget SECONDS] [--only NAMES]
    scripts/gpu_check.sh --part 1 [--dry]                      # the same, $OUT as the output folder

Parts (see docs/gpu.md):

1. environment (nvidia-smi, torch / CUDA / Triton versions, which of the package's imports fail), the
   ``pytest -m gpu`` tests, attention forward + backward per attention variant (the SDPA backend that ran is
   read from the profiler), and the outlier probe's cost at ``observe.every = 100`` on a 130M model;
2. ``llama_1b`` training throughput: bf16, compile off / on, activation checkpointing none / selective;
3. the papers' 60M-130M flavors' training throughput, and each optimizer's step (OrthoAdam, SOAP and any
   optimizer added to ``optimizer.name``'s choices besides the plain torch ones) against AdamW's at the papers'
   batch (512 x 256 tokens);
4. ``llama_7b`` (bf16, full activation checkpointing, one 2,048-token sequence per rank and micro-step) trained a
   few steps on the one device, then rank 0 of its FSDP 8 and FSDP 4 x TP 2 layouts on torch's fake process group
   (``parallelism.fake_world_size``): each rank's measured peak memory against the dry-run planner's.

Every benchmark item runs in a worker process under its own time limit: an item that runs past it is killed
and recorded as ``timeout``, and the next item starts in a fresh worker, so one slow item does not lose the
others' results. The part as a whole stops starting items when its budget (default 560 s) is spent. Each part
writes ``gpu_check_part<N>.json`` (everything) and ``gpu_check_part<N>.md`` (the tables) to the output
folder, with ``gpu_check_part<N>.log`` (the workers' and pytest's output; ``gpu_check_partall.log`` for
``--part all``, whose parts share one chain of workers) and, with part 1, ``pytest_gpu.xml``.

Dry mode: device cpu, float32 (the CPU path of the trainer), the ``debug`` flavor of each model spec, a few
steps; ``torch.compile`` is switched to the ``aot_eager`` backend (Dynamo and AOT autograd trace as on the GPU,
no C++ / Triton code generation), so compile items exercise their tracing in seconds.
"""
