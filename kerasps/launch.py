"""`kerasps.launch`: the public names of `kerasps.ops.launch`, where they live."""

from kerasps.ops.launch import (
    MIN_WORKERS_ENV,
    REPORT_ENV,
    TASK_ENV,
    TRAINING_FINISHED_ENV,
    WORKERS_WANTED_ENV,
    Launcher,
    LaunchSpec,
    Task,
    TaskFailedError,
    check_engine,
    check_program,
    install_chief_handler,
    make_cluster,
    name_process,
    program_module,
    report_connected,
    request_workers,
    runs_program,
    tf_config,
)

__all__ = ["LaunchSpec", "Task", "Launcher", "TaskFailedError", "make_cluster", "tf_config",
           "install_chief_handler", "runs_program", "request_workers", "report_connected",
           "check_program", "check_engine", "program_module", "name_process", "REPORT_ENV",
           "TASK_ENV", "TRAINING_FINISHED_ENV", "MIN_WORKERS_ENV", "WORKERS_WANTED_ENV"]
