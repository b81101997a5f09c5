"""elastrain on Slurm: an sbatch script per job, and the job's status.

- `config.SlurmConfig`: what a job's sbatch script is made from (validated).
- `render.render(cfg)`: the script's text (pure; nothing talks to Slurm).
- `status`: `elastrain slurm status`, the run directory's members and goodput
  with squeue/sacct's view of the job.

See docs/guide/slurm.md.
"""
