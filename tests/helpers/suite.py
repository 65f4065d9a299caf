"""The order the suite runs its files in: the longest first (see tests/conftest.py)."""

# The test files that take longest, heaviest first: ordered by the seconds each took in a whole run's `--durations`
# and alone (`OMP_NUM_THREADS=1 pytest -n 0 --durations=0 tests/FILE`); re-measure when a file grows or a new one is
# slow. conftest.py's pytest_collection_modifyitems puts them first. `--dist loadfile` hands whole files to the two
# workers in collection order (pyproject.toml's addopts turn off xdist's reordering by test count, which put these
# files, of few but long tests, last): started first, each ends while the other worker still has short files to
# take, so both workers end together.
HEAVY_FIRST = (
    "test_parallel.py",
    "test_distill.py",
    "test_commands_enumerated.py",
    "test_parallel_signals.py",
    "test_retrieval_ray.py",
    "test_train.py",
    "test_guides.py",
    "test_demo.py",
    "test_serve_workers.py",
    "test_heads.py",
    "test_checkpoints.py",
    "test_cache_keys.py",
    "test_deploy_export.py",
    "test_pair.py",
    "test_eval_sts.py",
    "test_index_integrity.py",
    "test_model_folders.py",
    "test_st_folders.py",
    "test_served_quality.py",
    "test_two_step.py",
    "test_smae.py",
)
