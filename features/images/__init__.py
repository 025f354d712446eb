"""Image features: the regions, grid and global stages."""
