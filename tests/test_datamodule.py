import shutil

from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.packing import PackedBatch


def test_train_and_val_folders_are_used_as_given(project_root):
    datamodule = PackedImageDataModule(str(project_root / "data" / "shapes"), patch_size=16, max_patches=64)
    datamodule.setup("fit")
    sizes = {name: len(dataset) for name, dataset in datamodule.datasets.items()}
    assert sizes == {"train": 192, "val": 48, "test": 48}
    assert datamodule.num_classes == 6
    assert datamodule.datasets["train"].hflip == 0.5 and datamodule.datasets["val"].hflip == 0.0


def test_a_flat_folder_is_split_by_seed_and_every_image_is_batched_once(project_root, tmp_path):
    shutil.copytree(project_root / "data" / "shapes" / "train", tmp_path / "images")
    splits = []
    for _ in range(2):
        datamodule = PackedImageDataModule(
            str(tmp_path / "images"), patch_size=16, max_patches=64, num_workers=0
        )
        datamodule.setup("fit")
        splits.append([path for path, _ in datamodule.datasets["val"].items])
    assert splits[0] == splits[1] and len(splits[0]) == round(192 * 0.1)
    train_paths = {path for path, _ in datamodule.datasets["train"].items}
    assert train_paths.isdisjoint(splits[0]) and len(train_paths) == 192 - len(splits[0])

    batches = list(datamodule.val_dataloader())
    assert all(isinstance(batch, PackedBatch) for batch in batches)
    assert sum(batch.num_images for batch in batches) == len(splits[0])


def test_batches_deliver_exactly_the_planned_sizes(project_root):
    datamodule = PackedImageDataModule(
        str(project_root / "data" / "shapes"),
        patch_size=16,
        max_patches=64,
        min_patches=4,
        token_drop_rate=0.3,
        token_drop_by_resolution=True,
        rows=4,
        row_len=64,
        num_workers=0,
    )
    datamodule.setup("fit")
    assert datamodule.train_policy.drop_by_resolution and datamodule.eval_policy.drop_rate == 0
    loader = datamodule.train_dataloader()
    planned = list(loader.batch_sampler)
    delivered = list(loader)
    assert len(planned) == len(delivered)
    for keys, batch in zip(planned, delivered, strict=True):
        assert batch.num_images == len(keys)
        assert batch.num_real_tokens == sum(key.keep for key in keys)
        # Dropped tokens keep their place in the image grid.
        real = batch.image_ids >= 0
        assert (batch.coords[real] < batch.grid.max()).all()
