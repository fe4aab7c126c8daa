from estimator.cli import entry

entry()
