"""The tensors a training step sends between tasks, read from TensorFlow's partitioned graphs.

Every tensor that crosses from one task to another in a step is one gRPC transfer: a
request from the receiving task, a response, their framing, and executor work on both
sides. TensorFlow writes the graphs it partitions over the tasks when
`TF_DUMP_GRAPH_PREFIX` is set; each `_Recv` whose sender is another task is one such
transfer. This script runs `embedding_scaling.py`'s workload (Embedding(200,000, 32) in
2 shards over 2 ps tasks, Dense(32), Dense(1), 2 workers, steps_per_execution 10) on an
in-process cluster in a child process with the dump on, and lists what crosses in one
step of the steady-state training function (the body of its `tf.while_loop`, run by
every step but the first of an execution), per worker:

    python benchmarks/crossings.py                 # SGD, a table
    python benchmarks/crossings.py --optimizer adam --json
    python benchmarks/crossings.py --logs           # with a callback reading batch logs
    python benchmarks/crossings.py --gradients-apart  # each gradient crosses on its own
    python benchmarks/crossings.py --quick          # a smoke run: a 20,000-row table
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "CROSSINGS_RESULT "


def _task(device: str) -> str:
    """`/job:ps/replica:0/task:1/device:CPU:0` -> `ps:1`."""
    match = re.search(r"/job:([^/]+)/replica:\d+/task:(\d+)", device)
    return f"{match.group(1)}:{match.group(2)}"


def step_crossings(dump_dir: str) -> list[dict]:
    """What crosses between tasks in one loop iteration of the last traced training
    function in `dump_dir`, for one worker's call of it: one dict per transfer, with
    `sender`, `receiver`, `tensor` (the sending node) and `dtype` (a `tf.DType` name).

    TensorFlow partitions each worker's call on its own; a partition belongs to the
    worker it receives from or sends to (a ps partition names one worker only). The
    first worker that ran the function is the one reported.
    """
    from google.protobuf import text_format
    from tensorflow.core.framework import graph_pb2, types_pb2

    files = glob.glob(os.path.join(dump_dir, "*train_function_*_partition__job:*"
                                              "after_partition_passes.pbtxt"))
    ids = {int(re.search(r"train_function_(\d+)_partition", f).group(1)) for f in files}
    if not ids:
        raise FileNotFoundError(f"No partitioned training function in {dump_dir!r}.")
    latest = f"train_function_{max(ids)}_partition__"
    per_worker = collections.defaultdict(list)
    for path in sorted(f for f in files if latest in f):
        graph = graph_pb2.GraphDef()
        with open(path) as f:
            text_format.Parse(f.read(), graph)
        received, workers = [], set()
        for node in graph.node:
            if node.op not in ("_Recv", "_HostRecv"):
                continue
            sender = _task(node.attr["send_device"].s.decode())
            receiver = _task(node.attr["recv_device"].s.decode())
            workers |= {task for task in (sender, receiver) if task.startswith("worker")}
            tensor = node.attr["tensor_name"].s.decode()
            if sender != receiver and ("while/body" in tensor or "while/LoopCond" in tensor):
                received.append({
                    "sender": sender, "receiver": receiver,
                    "tensor": re.sub(r"^edge_\d+_", "", tensor),
                    "dtype": types_pb2.DataType.Name(node.attr["tensor_type"].type)
                    .removeprefix("DT_").lower()})
        if len(workers) == 1:
            per_worker[workers.pop()] += received
    return per_worker[min(per_worker)] if per_worker else []


def child(optimizer: str, dump_dir: str, logs: str = "no", gradients: str = "together",
          vocab: str = "200000"):
    sys.path.insert(0, HERE)
    import embedding_scaling as es
    import keras

    import kerasps
    import kerasps.cluster
    from kerasps.backend import _keras

    if gradients == "apart":  # as before the small gradients of a ps task were packed
        _keras.PACKED_GRADIENT_BYTES = 0

    vocab = int(vocab)
    strategy = es.kerasps_strategy(kerasps.cluster.in_process(num_workers=2, num_ps=2),
                                   optimizer, num_ps=2)
    with strategy.scope():
        model = es._compiled_model(keras, vocab, optimizer)
    # 4 executions: the first and last return logs, the two between use the
    # steady-state function (no logs), the last one traced; with a callback that
    # reads every batch's logs, all 4 return them.
    reads_logs = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    model.fit(kerasps.DatasetCreator(es._dataset_fn(vocab)), epochs=1,
              steps_per_epoch=4 * es.SPE, verbose=0,
              callbacks=[reads_logs] if logs == "logs" else [])
    print(RESULT + json.dumps(step_crossings(dump_dir)), flush=True)


def measure(optimizer: str = "sgd", logs: bool = False, gradients_apart: bool = False,
            timeout: float = 600, vocab: int = 200_000) -> list[dict]:
    """Runs `child` in a fresh process (TensorFlow reads the dump settings once) and
    returns its crossings; with `logs`, those of the function that returns the logs
    (run for every execution when a callback reads batch logs); with
    `gradients_apart`, each gradient crosses to its ps task on its own."""
    with tempfile.TemporaryDirectory(prefix="kerasps-crossings-") as dump_dir:
        env = dict(os.environ, TF_DUMP_GRAPH_PREFIX=dump_dir, TF_DUMP_GRAPH_NAME_FILTER="*",
                   TF_DUMP_GRAPH_GROUPS="main", TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run([sys.executable, __file__, "--child", optimizer, dump_dir,
                               "logs" if logs else "no",
                               "apart" if gradients_apart else "together", str(vocab)],
                              env=env, capture_output=True, text=True, timeout=timeout)
        for line in done.stdout.splitlines():
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise RuntimeError(f"crossings child failed (rc {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def table(crossings: list[dict]) -> str:
    counts = collections.Counter((c["sender"], c["receiver"], c["tensor"], c["dtype"])
                                 for c in crossings)
    lines = ["| from | to | tensor | dtype |", "|---|---|---|---|"]
    lines += [f"| {s} | {r} | `{t}` | {d}{f' (x{n})' if n > 1 else ''} |"
              for (s, r, t, d), n in sorted(counts.items())]
    return "\n".join(lines + [f"\n{len(crossings)} tensors cross tasks per step."])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="sgd",
                        choices=("sgd", "adagrad", "adam", "lazy_adam"))
    parser.add_argument("--logs", action="store_true",
                        help="the function that returns logs (a batch-level callback)")
    parser.add_argument("--gradients-apart", action="store_true",
                        help="each gradient crosses on its own (as before they were packed)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a 20,000-row table (2 shards still; the same "
                             "tensors cross)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(*args.child)
    crossings = measure(args.optimizer, args.logs, args.gradients_apart,
                        vocab=20_000 if args.quick else 200_000)
    print(json.dumps(crossings) if args.json else table(crossings))


if __name__ == "__main__":
    main()
