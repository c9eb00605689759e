"""Small, deterministic demo datasets, generated offline.

Two kinds of demo data let every template run end to end without a real robot or camera:

* :func:`make_vla_demo` / :func:`make_vla_demo_v21` write a language-conditioned pick task as a
  LeRobot dataset (layout v3.0 or v2.1). A point gripper above a table must pick up the block
  whose colour the instruction names. Block positions change every episode and appear only in
  the camera image, so a policy needs image, state *and* instruction to act well.
* :func:`make_3dgs_demo` writes a synthetic scene of coloured 3D Gaussians in COLMAP layout
  (``images/`` + ``sparse/0/``), with images rendered by the same splatting model a 3D Gaussian
  Splatting trainer fits.

The datasets are versioned with DVC, where identical bytes mean an identical revision, so the
same arguments always give byte-identical files: no timestamps, sorted JSON keys, fixed PNG and
Parquet writer settings, and no pandas metadata. Bytes are reproducible for a given environment
(numpy, pyarrow, Pillow and zlib versions); another zlib may compress PNGs differently.
"""

from det_lab.data.demo_3dgs import make_3dgs_demo
from det_lab.data.demo_lerobot import IMAGE_KEY, IMAGE_PATH, make_vla_demo, make_vla_demo_v21
from det_lab.data.demo_pick import VLA_TASKS

__all__ = [
    "IMAGE_KEY",
    "IMAGE_PATH",
    "VLA_TASKS",
    "make_3dgs_demo",
    "make_vla_demo",
    "make_vla_demo_v21",
]
