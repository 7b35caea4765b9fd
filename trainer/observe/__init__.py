"""What people and systems see of a run: per-step metrics (rich, OpenTelemetry, Prometheus),
the run's status (``status.json`` or the TrainingRun's ``/status``), reward-hacking audits, and
the end-of-run report with its plots and many-domain tables."""
