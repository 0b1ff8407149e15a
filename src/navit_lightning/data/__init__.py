"""Image data sets, their packing into batches, and the LightningDataModule."""
