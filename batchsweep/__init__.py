"""batchsweep's one installed import name. Its three floors live at the checkout's top and are installed under it:

    from batchsweep.trainers import TrainConfig, train   # trainers/: one configuration, trained exactly
    from batchsweep.sweeps.study.files import load       # sweeps/: studies, Optuna and MLflow
    from batchsweep.analysis.runs import load_studies    # analysis/: runs -> figures -> report

In a checkout that is not installed (PYTHONPATH=the checkout, as on a bare GPU machine), they are found beside
this folder.
"""
import os

_top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_top, "sweeps", "run.py")):  # a checkout: the floors are its top-level folders
    __path__.append(_top)
