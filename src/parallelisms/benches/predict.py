"""``bench predict``: the step model (perf/step.py) against measured step times on this machine."""

from parallelisms.bench import bench


@bench("predict")
def bench_predict(args) -> dict:
    from parallelisms.perf.predict import bench_predict as run

    return run(args)
