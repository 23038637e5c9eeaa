"""`ftflow`: the command line of ftflow's flows and stack.

    ftflow run [--params FILE] [--set train.epochs=3 ...]   the finetune flow
    ftflow sweep [--params FILE] [--set sweep.trials=8 ...] the sweep flow: Ray Tune over train.* fields
    ftflow infer MODEL INPUT... OUTPUT [--batch-size 128 ...]  the batch_infer flow
    ftflow params [--schema]                                 run's parameters: defaults, descriptions
    ftflow stack up|down                                     the local stack (infra/local/stack.py)
    ftflow deploy --pool NAME [--image IMAGE]                the deployments, on a work pool
    ftflow new-data TRAIN_URI                                the retraining deployment's "new data" event
    ftflow doctor [--ray-address ADDR] [--storage-root ROOT] what a run needs, checked in about a minute

Parameters are validated as the Prefect form validates them (the same pydantic models), before any
cluster work. Bad input is one line and exit code 2; any other failure one line and exit code 1;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer
import typer._click as click  # typer 0.29 carries its own click: its exceptions are these
from pydantic import ValidationError

from ftflow import console
from ftflow.params import BadInput, as_yaml, escape, fields_help, parameters, value
from tasks.core.config import RAY_ADDRESS, BatchInferParams, FinetuneParams, default_storage_root
from tasks.core.strict import first_line as config_first_line
from tasks.core.strict import one_line
from tasks.core.sweep_config import SweepParams

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    help="Fine-tune Hugging Face classifiers and label corpora with them: Prefect + Ray + DeepSpeed.",
)
stack_app = typer.Typer(
    no_args_is_help=True, help="The local stack: Prefect server and UI, a Ray head, the deployments' runner."
)
app.add_typer(stack_app, name="stack")

Verbose = Annotated[
    bool, typer.Option("--verbose", "-v", help="Show Ray's, DeepSpeed's, transformers' and Prefect's own output too.")
]
Debug = Annotated[bool, typer.Option("--debug", help="On an error, show its traceback instead of one line.")]
BAD_INPUT = (ValidationError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


@app.command(epilog="[bold]Fields[/] (--set NAME=VALUE, or in the --params file):\n\n" + fields_help(FinetuneParams))
def run(
    params_file: Annotated[
        Path | None,
        typer.Option("--params", help="FinetuneParams as a JSON or YAML file (`ftflow params` writes one)."),
    ] = None,
    assignments: Annotated[
        list[str],
        typer.Option("--set", help="One field, e.g. train.epochs=3 (repeatable; values as YAML; over --params)."),
    ] = [],  # noqa: B006 (typer reads it as the option's default; nothing mutates it)
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Fine-tune, evaluate, promote and label: the finetune flow, on the embedded defaults unless told."""
    launched("finetune", parameters(FinetuneParams, params_file, assignments), verbose)


@app.command(epilog="[bold]Fields[/] (--set NAME=VALUE, or in the --params file):\n\n" + fields_help(SweepParams))
def sweep(
    params_file: Annotated[
        Path | None, typer.Option("--params", help="SweepParams as a JSON or YAML file: run's, and sweep.*.")
    ] = None,
    assignments: Annotated[
        list[str],
        typer.Option(
            "--set",
            help="One field, e.g. 'sweep.space.train.learning_rate={loguniform: [1e-5, 5e-4]}' or sweep.trials=8.",
        ),
    ] = [],  # noqa: B006 (typer reads it as the option's default; nothing mutates it)
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Search train.* fields with Ray Tune (ASHA stops the trials that trail), then evaluate, promote and
    label with the best trial's model: the sweep flow."""
    launched("sweep", parameters(SweepParams, params_file, assignments), verbose)


def launched(flow_name: str, params: FinetuneParams, verbose: bool) -> None:
    """The flow on params, once the flow's own checks of the data, model and storage pass, with the
    console's bars and its summary at the end."""
    from tasks.core.layout import RunStore
    from tasks.validate import run_inputs

    run_inputs(params, RunStore(params.storage_root, params.run_id) if params.run_id else None)
    with flow_console(verbose) as (say, api_answering):
        # Prefect and the ML stack load only once the input is good
        flow = getattr(importlib.import_module(f"flows.{flow_name}"), flow_name)
        api_answering()
        summary = flow(params)
        say.result(
            {f"test {name.replace('_', ' ')}": f"{value:.4f}" for name, value in summary.test.items()}
            | {
                "promoted": "yes" if summary.promoted else "no",
                "run id": summary.run_id,
                "artifacts": summary.run_dir,
                "report": summary.report,
            }
        )


@contextmanager
def flow_console(verbose: bool) -> Iterator[tuple[console.Say, Callable[[], None]]]:
    """The console's session (ftflow/console.py) and, inside it, Prefect's temporary server where no API
    is given; yields the console and a callable that waits until the server answers. Started inside
    the session, the server prints into the command's log with the rest of Prefect: started before it,
    the server wrote its records (an offline telemetry attempt's ERROR) on the user's terminal."""
    import prefect.main  # noqa: F401 -- Prefect sets its logging up at this import: before the console takes its loggers over

    from ftflow.temporary_api import temporary_api

    with console.session(verbose) as say:
        yield say, temporary_api()


@app.command()
def params(
    schema: Annotated[
        bool, typer.Option("--schema", help="The JSON schema (what the Prefect form is built from) instead.")
    ] = False,
) -> None:
    """run's parameters: the defaults as YAML for --params, each under its description."""
    print(
        json.dumps(FinetuneParams.model_json_schema(), indent=2) if schema else as_yaml(FinetuneParams),
        end="\n" if schema else "",
    )


# `ftflow infer`'s arguments; each other field of BatchInferParams is an option of the same name.
INFER_ARGUMENTS = ("model_uri", "input_uri", "output_uri")


def with_infer_options(command: Callable) -> Callable:
    """command, taking an option per BatchInferParams field past its arguments, with the field's
    description and default as help: generated, so the command and the flow's form cannot drift.
    (typer reads a command's options from its signature only.)"""
    options = [
        inspect.Parameter(
            name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation=Annotated[
                str | None,
                typer.Option(
                    f"--{name.replace('_', '-')}",
                    metavar=name.upper(),
                    help=escape(
                        field.description + (f" [default: {field.default}]" if field.default is not None else "")
                    ),
                    show_default=False,
                ),
            ],
        )
        for name, field in BatchInferParams.model_fields.items()
        if name not in INFER_ARGUMENTS
    ]
    signature = inspect.signature(command, eval_str=True)
    named = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    arguments = [p for p in named if p.name in INFER_ARGUMENTS]
    flags = [p for p in named if p.name not in INFER_ARGUMENTS]  # --verbose, --debug
    command.__signature__ = signature.replace(parameters=[*arguments, *options, *flags])
    return command


@app.command()
@with_infer_options
def infer(
    model_uri: Annotated[
        str, typer.Argument(metavar="MODEL", help=escape(BatchInferParams.model_fields["model_uri"].description))
    ],
    input_uri: Annotated[
        list[str], typer.Argument(metavar="INPUT", help="Files, folders or globs to label (local or s3://).")
    ],
    output_uri: Annotated[
        str, typer.Argument(metavar="OUTPUT", help=BatchInferParams.model_fields["output_uri"].description)
    ],
    verbose: Verbose = False,
    debug: Debug = False,
    **options: str | None,
) -> None:
    """Label every row of INPUT with MODEL: the batch_infer flow; Parquet (id, text, the predictions) in OUTPUT."""
    given = {name: value(text) for name, text in options.items() if text is not None}
    try:
        params = BatchInferParams.model_validate(
            {
                "model_uri": model_uri,
                "input_uri": input_uri[0] if len(input_uri) == 1 else input_uri,
                "output_uri": output_uri,
                **given,
            }
        )
    except ValidationError as error:
        raise BadInput(one_line(error)) from None
    from tasks.validate import batch_infer_inputs  # the flow's own checks, before anything starts

    batch_infer_inputs(params)
    with flow_console(verbose) as (say, api_answering):
        from flows.batch_infer import batch_infer  # Prefect and the ML stack load only now

        api_answering()
        result = batch_infer(params)
        say.result({"rows": f"{result.rows:,}", "rows/s": f"{result.rows_per_s:,.0f}", "predictions": output_uri})


@stack_app.command()
def up() -> None:
    """Start what is not running yet; prints the UI and the addresses to use."""
    local_stack().up()


@stack_app.command()
def down() -> None:
    """Stop the runner (no new runs), then the Ray head, then the server."""
    local_stack().down()


def local_stack():
    from infra.local import stack  # only the stack's commands need it

    return stack


@app.command(name="new-data")
def new_data(
    train_uri: Annotated[
        str,
        typer.Argument(metavar="TRAIN_URI", help="The new training data: files, a folder or a glob (local or s3://)."),
    ],
) -> None:
    """Tell the Prefect server at PREFECT_API_URL that new training data is there: finetune/retrain trains on it.

    The event ftflow.data.arrived (tasks/prefect_side/events.py) triggers the retraining deployment (deployments/definitions.py)."""
    from prefect.settings import PREFECT_API_URL

    from tasks.prefect_side.events import DATA_ARRIVED, data_arrived

    if not PREFECT_API_URL.value():
        raise BadInput(
            "PREFECT_API_URL is not set: the event goes to the Prefect server the deployments are served from "
            "(`ftflow stack up` prints it)"
        )
    data_arrived(train_uri)
    print(f"{DATA_ARRIVED}: {train_uri} (to {PREFECT_API_URL.value()})")


@app.command()
def deploy(
    pool: Annotated[str, typer.Option(help="The Prefect work pool that runs the flows.")],
    image: Annotated[
        str | None, typer.Option(help="For pools that start a container per run: the image holding ftflow.")
    ] = None,
) -> None:
    """Register the deployments (deployments/definitions.py) with a work pool of the server at PREFECT_API_URL.

    A process pool's workers run each flow where ftflow is installed (infra/prefect/worker.yaml); a pool
    that starts a container per run (Kubernetes, Docker) needs --image (infra/docker/Dockerfile). The
    flows reach Ray through RAY_ADDRESS in the worker's or the job's environment. Nothing is built or pushed.
    """
    from prefect import deploy as register

    from deployments.definitions import deployments, limit_concurrency

    limit_concurrency()
    register(*deployments(), work_pool_name=pool, image=image, build=False, push=False, ignore_warnings=True)


@app.command()
def doctor(
    ray_address: Annotated[str | None, typer.Option(help=escape(RAY_ADDRESS))] = None,
    storage_root: Annotated[
        str | None, typer.Option(help="The storage root to check; default: FTFLOW_STORAGE_ROOT or ./artifacts.")
    ] = None,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Check what a run needs, in about a minute: the Ray cluster, one DeepSpeed step and an all-reduce on
    its devices, bf16, DeepSpeed's CPU Adam op, storage, the Prefect API. One line per check; exit code 1
    if one fails."""
    from tasks import doctor  # Ray and the ML stack load only now

    styles = {"pass": "green", "warn": "yellow", "skip": "dim", "fail": "red"}
    with console.session(verbose) as say:

        def show(check: doctor.Check) -> None:  # no markup: a detail may hold [brackets]
            say.console.print(check.line(), style=styles[check.outcome], markup=False, highlight=False, soft_wrap=True)

        passed = doctor.run(ray_address, storage_root or default_storage_root(), show)
    if not passed:
        raise typer.Exit(1)


def command_name(argv: list[str]) -> str:
    return " ".join(["ftflow", *[a for a in argv[:1] if not a.startswith("-")]])


def main(argv: list[str] | None = None) -> None:
    """The console script: errors as one line (exit 2 for bad input, 1 otherwise) unless --debug."""
    argv = sys.argv[1:] if argv is None else argv
    exit_now(exit_code(argv))


def exit_code(argv: list[str]) -> int:
    try:
        # Not standalone, click returns a typer.Exit's code (a command's, --help's) rather than exiting with it.
        return typer.main.get_group(app).main(argv, prog_name="ftflow", standalone_mode=False) or 0
    except (typer.Abort, KeyboardInterrupt):
        return 130
    except click.exceptions.NoArgsIsHelpError:  # the help is printed: a usage error with nothing more to say
        return 2
    except click.exceptions.ClickException as error:  # usage: an unknown option, a missing argument
        console.error(f"{command_name(argv)}: {error.format_message()} (see --help)")
        return 2
    except Exception as error:  # noqa: BLE001 -- every failure ends as one line, its traceback only when asked
        bad = isinstance(error, (BadInput, *BAD_INPUT))
        if "--debug" in argv:
            console.error(traceback.format_exc().rstrip())
        else:
            console.error(
                f"{command_name(argv)}: {first_line(error)}"
                + ("" if bad else f" ({type(error).__name__}; --debug for the traceback)")
            )
        return 2 if bad else 1


def exit_now(code: int) -> NoReturn:
    """Exit through the usual handlers (Prefect's logs sent, its server stopped, Ray's shutdown), with
    every object alive now frozen out of the interpreter's last garbage collection: it walked them all
    for 2.3 s after every `ftflow run` on this CPU, to free what the process was about to lose anyway."""
    gc.freeze()
    sys.exit(code)


def first_line(error: Exception) -> str:
    return one_line(error) if isinstance(error, ValidationError) else config_first_line(error)


if __name__ == "__main__":
    main()
