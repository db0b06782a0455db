"""The `kerasps` command line.

    kerasps demo [--workers N] [--ps N] [--epochs N] [--steps-per-epoch N]
    kerasps serve            # run this worker/ps task of the cluster in $TF_CONFIG
    kerasps launch [--workers N|MIN:MAX] [--ps N] [--max-restarts K] [--gpus-per-worker G]
                   [--evaluator] [--engine local|ray [--address ADDRESS]]
                   [--emit k8s --image IMAGE [--name NAME] [--output-dir DIR]]
                   (script.py | -m package.module) [args ...]
    kerasps --version
"""

from __future__ import annotations

import argparse
import os
import re
import sys


class _Parser(argparse.ArgumentParser):
    """Argument errors in one style, Keras': "Invalid value for argument `--ps`: it must
    be a positive integer. Received: --ps='0'" (argparse's own prefix, `argument --ps:`,
    would name the option twice)."""

    def error(self, message):
        message = re.sub(r"^argument [^:]+: (?=Invalid value for argument )", "", message)
        super().error(message)


def _invalid(option: str, why: str, text) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(
        f"Invalid value for argument `{option}`: {why}. Received: {option}={text!r}")


def _int_option(option: str, minimum: int):
    """An argparse type: an integer >= `minimum`, refused naming `option`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise _invalid(option, f"it must be {kind}", text)
        return value

    return parse


def _engine(text):
    from kerasps.ops.launch_spec import ENGINES

    if text not in ENGINES:
        raise _invalid("--engine", f"expected one of {', '.join(ENGINES)}", text)
    return text


def parser() -> argparse.ArgumentParser:
    from kerasps import __version__

    top = _Parser(prog="kerasps", description=__doc__.split("\n")[0])
    top.add_argument("--version", action="version", version=f"kerasps {__version__}")
    commands = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser(
        "demo", help="train a small recommendation model on an in-process cluster",
        description="Trains a recommendation-style model (sharded user embedding + MLP) on "
                    "synthetic clicks with an in-process cluster, printing progress, the "
                    "placement table and the final metrics. TensorFlow's own lines are not "
                    "shown; KERASPS_TF_LOGS=1 shows them.")
    demo.add_argument("--workers", type=_int_option("--workers", 1), default=2,
                      help="worker tasks (default 2)")
    demo.add_argument("--ps", type=_int_option("--ps", 1), default=2, help="ps tasks (default 2)")
    demo.add_argument("--epochs", type=_int_option("--epochs", 1), default=3,
                      help="epochs (default 3)")
    demo.add_argument("--steps-per-epoch", type=_int_option("--steps-per-epoch", 1), default=50,
                      help="training steps per epoch, over all workers (default 50)")
    demo.add_argument("--placement", choices=["round_robin", "greedy"], default="round_robin",
                      help="variable placement policy (default round_robin)")
    demo.add_argument("--verbose", type=int, choices=[0, 1, 2], default=1,
                      help="Keras verbosity: 1 = live progress bar (default), 2 = one line "
                           "per epoch, 0 = silent")
    commands.add_parser(
        "serve", help="run this process's worker or ps task of the cluster in $TF_CONFIG",
        description="Starts the TensorFlow server of the worker or ps task that $TF_CONFIG "
                    "names (as Kubernetes TFJob and similar launchers set it) and serves "
                    "until killed. The chief runs the training program with "
                    "kerasps.cluster.from_tf_config().")
    launch = commands.add_parser(
        "launch", help="run a script or module as the chief of a local multi-process cluster",
        usage="%(prog)s [options] script.py [args ...]\n"
              "       %(prog)s [options] -m package.module [args ...]",
        description="Starts one process per task on this machine (workers and ps tasks as "
                    "`kerasps serve`, the chief as `python script.py args`, or with -m as "
                    "`python -m package.module args`), each with its own "
                    "TF_CONFIG on loopback ports, restarts failed tasks (the chief included) on "
                    "the same address, and ends every process when the chief exits with "
                    "status 0 or on Ctrl-C. "
                    "With --emit k8s, writes Kubernetes manifests for the same job instead.")
    launch.add_argument("--workers", type=_worker_range, default=(2, 2),
                        help="worker tasks: N, or MIN:MAX for an elastic pool: MAX workers "
                             "are declared and all start (TensorFlow's coordinator connects to "
                             "each once), then the pool shrinks to MIN; `kerasps.launch."
                             "request_workers(n)` (or writing n to $KERASPS_WORKERS_WANTED) "
                             "resizes it (default 2)")
    launch.add_argument("--ps", type=_int_option("--ps", 1), default=1, help="ps tasks (default 1)")
    launch.add_argument("--max-restarts", type=_int_option("--max-restarts", 0), default=3,
                        help="restarts allowed per task: chief, worker, ps or evaluator "
                             "(default 3)")
    launch.add_argument("--gpus-per-worker", type=_int_option("--gpus-per-worker", 1), default=None,
                        help="GPUs per worker, split through CUDA_VISIBLE_DEVICES")
    launch.add_argument("--evaluator", action="store_true",
                        help="also run the program as task `evaluator 0` for side-car evaluation "
                             "(kerasps.SidecarEvaluator)")
    launch.add_argument("--tf-logs", action="store_true",
                        help="keep TensorFlow's lines (start-up notices, CUDA and oneDNN, "
                             "its C++ log) in the tasks' output, as KERASPS_TF_LOGS=1 does: "
                             "the tasks run with KERASPS_TF_LOGS=1 and TF_CPP_MIN_LOG_LEVEL "
                             "as it is; by default they are dropped")
    launch.add_argument("--engine", type=_engine, default="local",
                        help="where the worker and ps tasks run: local (default: a process "
                             "each on this machine) or ray (Ray actors, which the chief, the "
                             "Ray driver, starts in kerasps.cluster.resolve(); Ray restarts "
                             "each up to --max-restarts times; needs kerasps[ray])")
    launch.add_argument("--address", default=None,
                        help="with --engine ray: the Ray cluster to run on, as ray.init takes "
                             "it (auto, host:6379, ray://host:10001); default $RAY_ADDRESS's, "
                             "else a local Ray")
    launch.add_argument("--emit", choices=["k8s"], default=None,
                        help="write Kubernetes manifests for the job, run nothing: a JobSet "
                             "(NAME.jobset.yaml) and a Kubeflow v1 TFJob (NAME.tfjob.yaml), or "
                             "with --engine ray a KubeRay RayJob (NAME.rayjob.yaml); the "
                             "script's path is taken relative to the image's working directory "
                             "(a -m module runs as `python -m` in the image)")
    launch.add_argument("--image", help="container image holding kerasps and the script "
                                        "(required with --emit)")
    launch.add_argument("--name", help="job name in the manifests, made a DNS-1035 label "
                                       "(default: the script's name, or the module's last "
                                       "component)")
    launch.add_argument("--output-dir", default=".", help="where --emit writes (default .)")
    launch.add_argument("-m", dest="module", nargs=argparse.REMAINDER,
                        help="MODULE [args ...]: run the chief (and the evaluator) as `python "
                             "-m MODULE args` does, the module found from the current "
                             "directory or on the Python path; as with python, everything "
                             "after the module's name is its own (e.g. `kerasps launch "
                             "--workers 2 -m trainer.main --epochs 5`)")
    launch.add_argument("program", nargs=argparse.REMAINDER,
                        help="the chief's script and its arguments")
    launch.set_defaults(command_parser=launch)  # for errors found after parsing
    return top


def _worker_range(text):
    from kerasps.policy import membership

    try:
        return membership.parse_workers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            str(error).replace("argument `workers`", "argument `--workers`")
            .replace("Received: workers=", "Received: --workers=")) from None


def _program(args, parser) -> tuple:
    """The chief's program from the command line: `(script, *args)`, or `("-m", module,
    *args)` for `-m module args`."""
    if args.module is None:
        if not args.program:
            parser.error("Invalid value for argument `program`: the chief's script is required "
                         "(kerasps launch [options] script.py [args], or -m package.module "
                         "[args]). Received: program=None")
        return tuple(args.program)
    # `-m module args` leaves everything in args.module: a program beside it came from
    # `-mmodule args` (its arguments then taken for a script's, or refused as options).
    if args.program:
        parser.error("Invalid value for argument `-m`: a script and a module cannot both be "
                     "given; write -m apart from the module's name (kerasps launch [options] "
                     "-m package.module [args]). "
                     f"Received: -m={args.module[0]!r} and program={args.program!r}")
    module, *rest = args.module or [None]
    if not module:
        parser.error("Invalid value for argument `-m`: the module to run is required "
                     "(kerasps launch [options] -m package.module [args]). "
                     f"Received: -m={module!r}")
    if module.startswith("-"):
        parser.error("Invalid value for argument `-m`: expected a module's name; the options "
                     "of kerasps launch go before -m (everything after the module's name is its "
                     f"own). Received: -m={module!r}")
    return ("-m", module, *rest)


def _launch(args, parser) -> int:
    from kerasps.backend import tf_logs
    from kerasps.ops import launch

    program = _program(args, parser)
    if args.emit is not None and not args.image:
        parser.error("Invalid value for argument `--image`: it is required with --emit (an "
                     "image holding kerasps and the script). Received: --image=None")
    low, high = args.workers
    if args.address is not None and args.engine != "ray":
        parser.error("Invalid value for argument `--address`: a Ray cluster's address, given "
                     f"with --engine ray only. Received: --address={args.address!r} with "
                     f"--engine={args.engine!r}")
    if args.engine == "ray" and (args.evaluator or low < high):
        option, value = (("--evaluator", True) if args.evaluator
                         else ("--workers", f"{low}:{high}"))
        parser.error(f"Invalid value for argument `{option}`: --engine ray runs a fixed pool "
                     "of workers and no side-car evaluator yet. "
                     f"Received: {option}={value!r} with --engine='ray'")
    spec = launch.LaunchSpec(program=program, workers=high, ps=args.ps,
                             min_workers=low if low < high else None,
                             max_restarts=args.max_restarts,
                             gpus_per_worker=args.gpus_per_worker, evaluator=args.evaluator,
                             engine=args.engine, address=args.address)
    if args.emit is None:
        try:
            launch.check_engine(spec)
        except ImportError as error:
            print(f"kerasps launch: {error}", file=sys.stderr)
            return 2
        try:
            launch.check_program(spec.program)
        except ValueError as error:
            module = launch.program_module(spec.program)
            if module is not None:  # as the command line named it
                error = (str(error).replace("argument `program`", "argument `-m`")
                         .replace(f"Received: program={spec.program[:2]!r}",
                                  f"Received: -m={module!r}"))
            parser.error(str(error))
        return launch.Launcher(spec, tf_logs=args.tf_logs or tf_logs.wanted()).run()
    from kerasps.ops import manifests

    module = launch.program_module(spec.program)
    if module is not None:  # `python -m module` in the image: no path to rewrite
        default_name, script = module.rsplit(".", 1)[-1], None
    else:
        default_name = os.path.splitext(os.path.basename(spec.program[0]))[0]
        script, warning = manifests.script_in_image(spec.program[0])
        if warning:
            print(f"kerasps launch: warning: {warning}", file=sys.stderr)
    name = manifests.job_name(args.name or default_name)
    os.makedirs(args.output_dir, exist_ok=True)
    outputs = ({f"{name}.rayjob.yaml": ("RayJob", manifests.rayjob)} if spec.engine == "ray"
               else {f"{name}.jobset.yaml": ("JobSet", manifests.jobset),
                     f"{name}.tfjob.yaml": ("TFJob", manifests.tfjob)})
    for filename, (kind, make) in outputs.items():
        path = os.path.join(args.output_dir, filename)
        with open(path, "w") as f:
            f.write(manifests.dump(make(spec, name, args.image, script),
                                   header=manifests.notes(spec, kind)))
        print(path)
    return 0


def _interrupted(command: str) -> int:
    """Ctrl-C: one line instead of a traceback (on a terminal, below the progress bar it
    interrupted), and exit status 130, as after SIGINT."""
    sys.stdout.flush()
    newline = "\n" if sys.stderr.isatty() else ""  # the bar's line has no newline yet
    print(f"{newline}{command}: stopped (Ctrl-C)", file=sys.stderr, flush=True)
    return 130


def main(argv=None) -> int:
    # TensorFlow's log lines are kept from the user by `import kerasps` (this module's
    # package): `kerasps.backend.tf_logs`; KERASPS_TF_LOGS=1 shows them.
    args = parser().parse_args(argv)
    if args.command == "demo":
        from kerasps.ops import console, demo

        try:
            with console.plain_stdout():  # to a file or a pipe: plain lines, as `launch`
                demo.run(demo.DemoConfig(workers=args.workers, ps=args.ps,
                                         epochs=args.epochs,
                                         steps_per_epoch=args.steps_per_epoch,
                                         placement=args.placement, verbose=args.verbose))
        except KeyboardInterrupt:
            return _interrupted("kerasps demo")
    elif args.command == "launch":
        return _launch(args, args.command_parser)
    elif args.command == "serve":
        from kerasps.runtime import cluster

        try:
            cluster.serve()
        except ValueError as e:
            print(f"kerasps serve: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
