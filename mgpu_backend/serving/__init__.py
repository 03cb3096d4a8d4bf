"""The fleet's processes: controller, fleet, worker, client, the CLI and the jobs a worker runs."""
