"""Record the reference dlrm_s_pytorch.py's printed training losses for the command lines that
tests/test_reference.py replays with jitkern (run by hand where the reference and torch exist):

    cd /path/to/facebookresearch/dlrm  # at 090956e
    python /path/to/jitkern/tests/reference/record.py OUT.json [--full]

Each entry: the extra flags (after the base command line), and the losses the reference printed.
"""
import json
import re
import subprocess
import sys

SMALL = ("--arch-sparse-feature-size=4 --arch-embedding-size=300-500-40 --arch-mlp-bot=13-8-4 "
         "--arch-mlp-top=8-1 --data-generation=random --mini-batch-size=32 --num-batches=12 "
         "--learning-rate=0.1 --print-freq=4 --numpy-rand-seed=727 --num-indices-per-lookup=4")
FULL = ("--arch-sparse-feature-size=8 --arch-embedding-size=1000-2000-3000-50 --arch-mlp-bot=13-16-8 "
        "--arch-mlp-top=16-1 --data-generation=random --mini-batch-size=128 --num-batches=60 "
        "--learning-rate=0.1 --print-freq=10 --numpy-rand-seed=727 --num-indices-per-lookup=4")
CASES = [
    "--loss-function=bce",
    "--loss-function=mse",
    "--loss-function=wbce --loss-weights=0.3-0.7",
    "--loss-function=bce --optimizer=adagrad",
    "--loss-function=bce --optimizer=rwsadagrad",
    "--loss-function=bce --arch-interaction-op=cat",
    "--loss-function=bce --arch-interaction-itself",
    "--loss-function=bce --num-indices-per-lookup-fixed=True",
    "--loss-function=bce --qr-flag",
    "--loss-function=bce --weighted-pooling=learned",
    "--loss-function=bce --round-targets=True",
    "--loss-function=bce --loss-threshold=0.49",
    "--loss-function=mse --loss-threshold=0.495 --optimizer=adagrad",
    "--loss-function=bce --rand-data-dist=gaussian --rand-data-min=0 --rand-data-max=39 --rand-data-mu=20 --rand-data-sigma=8",
    "--loss-function=bce --qr-flag --qr-operation=add --qr-collisions=3",
    "--loss-function=bce --qr-flag --qr-operation=concat --qr-threshold=30 --arch-mlp-bot=13-8-8",
    "--loss-function=bce --weighted-pooling=fixed",
    "--loss-function=bce --weighted-pooling=learned --optimizer=rwsadagrad",
    "--loss-function=wbce --loss-weights=0.3-0.7 --round-targets=True --optimizer=adagrad",
    "--loss-function=bce --nepochs=2 --data-size=300 --num-batches=0",
    "--loss-function=bce --md-flag --md-threshold=30",
    "--loss-function=mse --md-flag --md-threshold=30 --md-temperature=0.5 --optimizer=adagrad",
]
LOSS = re.compile(r"Finished training it (\d+)/(\d+) of epoch (\d+), .* loss (\S+)")


def main():
    out, full = sys.argv[1], "--full" in sys.argv
    base = FULL if full else SMALL
    records = []
    for case in CASES:
        if full and "concat" in case:
            case = case.replace("--arch-mlp-bot=13-8-8", "--arch-mlp-bot=13-16-16")
        cmd = [sys.executable, "dlrm_s_pytorch.py", *base.split(), *case.split()]
        p = subprocess.run(cmd, capture_output=True, text=True)
        losses = [[int(m[1]), int(m[3]), m[4]] for m in LOSS.finditer(p.stdout)]
        err = p.stderr.strip().splitlines()[-1] if p.returncode else ""
        records.append({"flags": case, "losses": losses, "returncode": p.returncode, "error": err})
        print(case, losses, err, flush=True)
    with open(out, "w") as f:
        json.dump({"base": base, "cases": records}, f, indent=1)


if __name__ == "__main__":
    main()
