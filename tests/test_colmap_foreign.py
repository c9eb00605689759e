"""det_lab's COLMAP reader on models written by pycolmap (COLMAP's own writer): every camera
model COLMAP has (ids 0-17), text and binary, and a camera rig whose images share file names."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from det_lab.scenes import (
    CAMERA_MODELS,
    SPHERICAL_MODELS,
    ColmapError,
    load_scene,
    read_model,
    render_key,
    render_keys,
)

pycolmap = pytest.importorskip("pycolmap")

W, H = 64, 48


def _params(model: str, n: int) -> list[float]:
    """Plausible parameters: focal, principal point, then small non-zero distortion terms."""
    if model == "EQUIRECTANGULAR":
        return [float(W), float(H)]
    names = CAMERA_MODELS[[k for k, (m, _) in CAMERA_MODELS.items() if m == model][0]][1]
    values = {"f": 50.0, "fx": 50.0, "fy": 52.0, "cx": 31.5, "cy": 23.5, "omega": 0.4, "alpha": 0.6, "beta": 1.1}
    return [values.get(name, 0.01 * (i + 1)) for i, name in enumerate(names)][:n]


def _rotation(angle: float) -> object:
    return pycolmap.Rotation3d(np.array([np.sin(angle / 2), 0.0, 0.0, np.cos(angle / 2)]))  # xyzw


def _write_model(out: Path, cameras: list[tuple[int, str, list[float]]], images: list[tuple[int, str, int]],
                 fmt: str) -> None:
    rec = pycolmap.Reconstruction()
    for cid, model, params in cameras:
        rec.add_camera_with_trivial_rig(pycolmap.Camera(camera_id=cid, model=model, width=W, height=H, params=params))
    for iid, name, cid in images:
        image = pycolmap.Image(image_id=iid, name=name, camera_id=cid)
        image.points2D = pycolmap.Point2DList([pycolmap.Point2D(np.array([10.0 + iid, 20.0]))])
        rec.add_image_with_trivial_frame(image, pycolmap.Rigid3d(_rotation(0.1 * iid), np.array([0.1 * iid, 0.0, 4.0])))
    track = pycolmap.Track()
    for iid, _, _ in images:
        track.add_element(iid, 0)
    rec.add_point3D(np.array([0.1, -0.2, 0.3]), track, np.array([200, 100, 50], dtype=np.uint8))
    out.mkdir(parents=True)
    (rec.write_text if fmt == "text" else rec.write_binary)(str(out))


@pytest.mark.parametrize("fmt", ["text", "binary"])
def test_every_colmap_camera_model_written_by_pycolmap(tmp_path: Path, fmt: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    models = [m.name for m in sorted(pycolmap.CameraModelId.__members__.values(), key=lambda m: m.value)
              if m.value >= 0]
    assert {k: m for k, (m, _) in CAMERA_MODELS.items()} == {
        pycolmap.CameraModelId.__members__[m].value: m for m in models}, "det_lab's table is COLMAP's"
    cameras = []
    for cid, model in enumerate(models, 1):
        n = pycolmap.Camera.create_from_model_name(cid, model, 50.0, W, H).params.size
        cameras.append((cid, model, _params(model, n)))
    sparse = tmp_path / "sparse" / "0"
    _write_model(sparse, cameras, [(cid, f"img{cid:02d}.png", cid) for cid, _, _ in cameras], fmt)

    with caplog.at_level(logging.WARNING, logger="det_lab.scenes"):
        model = read_model(sparse)
    assert model.format == fmt and len(model.cameras) == len(CAMERA_MODELS) == 18
    theirs = pycolmap.Reconstruction(str(sparse))
    warned = {r.getMessage().split("camera ")[1].split(" is")[0] for r in caplog.records}
    for cid, name, params in cameras:
        cam, ref = model.cameras[cid], theirs.cameras[cid]
        assert cam.model == name == ref.model.name
        np.testing.assert_allclose(cam.params, ref.params)
        if name in SPHERICAL_MODELS:
            with pytest.raises(ColmapError):
                cam.K  # noqa: B018
        else:
            np.testing.assert_allclose(cam.K, ref.calibration_matrix())
        # the rule: warn where the pinhole intrinsics leave something out; here only the pinholes don't
        must_warn = name not in ("SIMPLE_PINHOLE", "PINHOLE") and name not in SPHERICAL_MODELS
        assert (str(cid) in warned) == must_warn, name
    assert "FOV" in caplog.text and "omega" in caplog.text
    assert "FISHEYE; its fisheye projection is ignored" in caplog.text
    image = model.images[1]
    ref_image = theirs.images[1]
    np.testing.assert_allclose(image.R, ref_image.cam_from_world().rotation.matrix(), atol=1e-12)
    np.testing.assert_allclose(image.t, ref_image.cam_from_world().translation)
    assert len(model.points3d) == 1 and model.points3d.tracks[0][:, 0].tolist() == sorted(model.images)


@pytest.mark.parametrize("fmt", ["text", "binary"])
def test_zero_distortion_does_not_warn_but_fisheye_projection_does(tmp_path: Path, fmt: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    cameras = [(1, "FOV", [50.0, 50.0, 32.0, 24.0, 0.0]), (2, "SIMPLE_DIVISION", [50.0, 32.0, 24.0, 0.0]),
               (3, "EUCM", [50.0, 50.0, 32.0, 24.0, 0.0, 1.0]), (4, "SIMPLE_FISHEYE", [50.0, 32.0, 24.0]),
               (5, "FOV", [50.0, 50.0, 32.0, 24.0, 0.7])]
    _write_model(tmp_path / "m", cameras, [(1, "a.png", 1)], fmt)
    with caplog.at_level(logging.WARNING, logger="det_lab.scenes"):
        read_model(tmp_path / "m")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "camera 4 is SIMPLE_FISHEYE" in messages[0] + messages[1]
    assert "camera 5 is FOV; its distortion {'omega': 0.7} is ignored" in messages[0] + messages[1]


def _write_images(root: Path, names: list[str]) -> None:
    rng = np.random.default_rng(0)
    for name in names:
        path = root / "images" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)).save(path)


@pytest.mark.parametrize("fmt", ["text", "binary"])
def test_rig_images_in_subfolders_keep_apart(tmp_path: Path, fmt: str) -> None:
    names = ["cam0/0001.png", "cam1/0001.png", "cam0/0002.png", "cam1/0002.png"]
    _write_model(tmp_path / "sparse" / "0", [(1, "PINHOLE", [50.0, 50.0, 32.0, 24.0]),
                                             (2, "PINHOLE", [55.0, 55.0, 32.0, 24.0])],
                 [(i, n, 1 + i % 2) for i, n in enumerate(names)], fmt)
    _write_images(tmp_path, names)
    scene = load_scene(tmp_path)
    assert [v.name for v in scene.views] == sorted(names)
    keys = render_keys([v.name for v in scene.views])
    assert keys == ["cam0/0001", "cam0/0002", "cam1/0001", "cam1/0002"]
    # what the 3DGS template does with a key: one PNG per view under the renders folder
    renders = tmp_path / "renders" / "step_00000100"
    for key, view in zip(keys, scene.views):
        (renders / f"{key}.png").parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((view.image * 255).astype(np.uint8)).save(renders / f"{key}.png")
    assert len(list(renders.rglob("*.png"))) == len(names)


def test_spherical_camera_is_refused_by_load_scene(tmp_path: Path) -> None:
    _write_model(tmp_path / "sparse" / "0", [(1, "EQUIRECTANGULAR", [float(W), float(H)])],
                 [(1, "pano.png", 1)], "binary")
    _write_images(tmp_path, ["pano.png"])
    assert read_model(tmp_path / "sparse" / "0").cameras[1].model == "EQUIRECTANGULAR"
    with pytest.raises(ColmapError, match=r"cameras\.bin: camera 1 is EQUIRECTANGULAR, a spherical model") as info:
        load_scene(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "key"), [
    ("0001.png", "0001"), ("cam0/0001.png", "cam0/0001"), ("a/b/c.d.jpg", "a/b/c.d"),
    ("../../etc/passwd.png", "__/__/etc/passwd"), ("/abs/x.png", "abs/x"), ("dir\\win.png", "dir/win"),
    ("a b:c?.png", "a_b_c_"), ("./.hidden", ".hidden"), ("", "_"),
])
def test_render_key_is_a_safe_relative_key(name: str, key: str) -> None:
    assert render_key(name) == key
    assert not Path(key).is_absolute() and ".." not in Path(key).parts


def test_render_keys_are_unique() -> None:
    names = ["a b.png", "a_b.jpg", "a_b.png", "a_b-2.png", "x/0001.png", "x/0001.jpg"]
    keys = render_keys(names)
    assert len(set(keys)) == len(names)
    assert keys[:2] == ["a_b", "a_b-2"] and keys[4] == "x/0001"
