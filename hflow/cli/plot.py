"""Plot learning curves of one or more runs into one PNG.

    python -m hflow.cli.plot logs/hflow/run_a/metrics.jsonl logs/hflow/run_b/metrics.jsonl -o curves.png
"""

import argparse

from hflow.utils.plotting import plot_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by the jsonl logger")
    parser.add_argument("-o", "--output", default="learning_curves.png", help="PNG to write")
    parser.add_argument("--labels", nargs="*", help="one label per run (default: the run folder names)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        parser.error(f"--labels has {len(args.labels)} names for {len(args.metrics)} runs")
    print(plot_runs(args.metrics, args.output, args.labels))


if __name__ == "__main__":
    main()
