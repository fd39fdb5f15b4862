//! The node's devices as ResourceSlices: one pool per node, one device per GPU that can be
//! passed through.
