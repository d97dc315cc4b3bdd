/* The helpers' interface version. radixkv/native.py refuses a library whose version differs from its
 * own (a stale build left in a source tree after the sources changed, e.g. by a git pull without a
 * reinstall): it would call functions with other signatures. Bump it, and radixkv.native._ABI, with
 * any change to a signature or contract in this folder. */
int radixkv_native_abi(void) { return 1; }
