"""What a run shows: the files and pages it writes, and the tables the command line prints.

run_outputs: everything a run writes, behind one object the trainer feeds; trackers: one interface
(tracker_base) with CSV/JSONL (metrics_log), TensorBoard, MLflow (mlflow_tracker) and W&B
(wandb_tracker) behind it; progress: the progress bar; plots: curves.png; summary: the run's
summary as rows and a rich table; html: RUN_DIR/report.html (page: the shell of every page;
markdown: bench's index page; sweep_page: a sweep's report; startup_section: the time to the
first step, by part); tensorboard: TensorBoard event files at each log point; format: numbers for people; ray_report:
log points and committed checkpoints handed to Ray Train (`RayReport`, `resume_from_ray`).
"""
