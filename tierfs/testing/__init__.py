"""The harness of the tests, the benchmarks and the demo: mounts in a subprocess, a killable backing."""
