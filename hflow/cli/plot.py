"""Plot learning curves of one or more runs into one PNG.

    python -m hflow.cli.plot logs/hflow/run_a/metrics.jsonl logs/hflow/run_b/metrics.jsonl -o curves.png

The output is refused (`hflow: error:`, status 2) when it is one of the metrics files, a folder, or in a
training checkpoint folder (`hflow.utils.safe_output`); it is written beside its name and renamed into place.
"""

import argparse
import json
import sys

from hflow.utils.errors import UserError
from hflow.utils.plotting import plot_runs
from hflow.utils.safe_output import check_output_file, staged_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by the jsonl logger")
    parser.add_argument("-o", "--output", default="learning_curves.png", help="PNG to write")
    parser.add_argument("--labels", nargs="*", help="one label per run (default: the run folder names)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        parser.error(f"--labels has {len(args.labels)} names for {len(args.metrics)} runs")
    try:
        out = check_output_file(args.output, arg="--output", what="the plot",
                                inputs={f"the metrics file {i + 1}": path for i, path in enumerate(args.metrics)})
        with staged_file(out) as tmp:
            plot_runs(args.metrics, tmp, args.labels)
    except UserError as err:
        print(f"hflow: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a metrics file that cannot be read, an output that cannot be written
        print(f"hflow: error: {err.filename or args.output}: {err.strerror or err}; check the paths given to "
              "python -m hflow.cli.plot", file=sys.stderr)
        return 2
    except json.JSONDecodeError as err:
        print(f"hflow: error: a metrics file is not JSON lines ({err}); pass the metrics.jsonl files that "
              "trainer.logger=jsonl writes", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
