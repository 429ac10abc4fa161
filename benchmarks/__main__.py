from benchmarks.suite import main

if __name__ == "__main__":  # the suite's mode processes (spawned) import this module too
    raise SystemExit(main())
