"""Benchmarks of fleetgate and its peers, one script per question; results in bench/results/.

Run a bench as a module of this package, from the repository root, with the project's virtualenv:

    .venv/bin/python -m bench.bench_gateway [--seconds 5]

Each script's docstring says what it measures, how, and its flags; the measured figures live in
bench/results/<name>.json (and the .png drawn from it), not in the docstrings. `python -m bench.plots`
redraws every PNG from its JSON. Importing a module runs nothing: the work starts in `main()`.
"""
