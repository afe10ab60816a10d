"""`make demo` (`python -m demo.run`): one module per stage, run.py sequences them.

cluster, assets, job (with preempt), model (with inference), metrics (with plot); context
holds the state the stages share, ui what they print, prom the demo's Prometheus and targets
the thread that keeps its scrape targets current."""
