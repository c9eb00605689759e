"""LeRobot's own policies (ACT, Diffusion, ... any type its factory builds) trained by det_lab's trials.

    choice = parse_policy(hparams.get("policy"))           # no LeRobot import yet
    if choice.is_lerobot:
        frames = LeRobotDataset(path, cameras=...)          # det_lab's reader
        training = build_training(choice, dataset_meta(frames), device="cpu", total_steps=1000)
        items = PolicyFrames(frames, training.delta_indices, training.drop_n_last_frames)
        metrics = training.train_step(default_collate([items[i] for i in range(8)]))
        training.export(checkpoint_dir)                     # <dir>/pretrained_model/, LeRobot's files

:mod:`~det_lab.policies.training` builds and steps the policy as ``lerobot-train`` does,
:mod:`~det_lab.policies.batches` serves LeRobot's items from det_lab's reader, and
:mod:`~det_lab.policies.meta` gives LeRobot's factory the dataset's metadata. LeRobot is imported
only inside the functions that build a LeRobot policy.
"""

from det_lab.policies.batches import PolicyFrames
from det_lab.policies.choice import DEFAULT_TYPE, PolicyChoice, parse_policy
from det_lab.policies.errors import PolicyError
from det_lab.policies.meta import DatasetMeta, dataset_meta
from det_lab.policies.training import PRETRAINED_DIR, LeRobotTraining, build_training

__all__ = ["DEFAULT_TYPE", "PRETRAINED_DIR", "DatasetMeta", "LeRobotTraining", "PolicyChoice", "PolicyError",
           "PolicyFrames", "build_training", "dataset_meta", "parse_policy"]
