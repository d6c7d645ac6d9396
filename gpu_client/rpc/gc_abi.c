/*
 * gc_abi.c - the layout of the public structs as numbers (gc_abi_layout in moerpc_client.h),
 * for bindings that reach the library through a foreign function interface rather than the
 * header: the Python package (gpu_client/python, ctypes) builds gc_options, gc_layer_req,
 * gc_cluster_info and mr_err from these sizes and offsets instead of mirroring the structs
 * by hand. A field added to a struct therefore needs nothing on the Python side, and a
 * field the binding uses that is renamed or removed is refused when the binding loads (an
 * unknown name answers -1) instead of writing to the wrong bytes.
 *
 * Names: "<struct>" is sizeof, "<struct>.<field>" the offset of the field. Only the fields
 * a binding needs are listed; add a line when a binding needs another. Constants whose
 * value is negative (GC_OWNER_*) are not here, since -1 means "unknown name".
 */
#include <stddef.h>
#include <string.h>

#include "gpu_client/rpc/moerpc_client.h"

typedef struct abi_entry {
  const char *name;
  size_t value;
} abi_entry;

#define ABI_SIZE(t) {#t, sizeof(t)}
#define ABI_FIELD(t, f) {#t "." #f, offsetof(t, f)}

static const abi_entry abi_table[] = {
    ABI_SIZE(mr_err),
    ABI_FIELD(mr_err, code),
    ABI_FIELD(mr_err, msg),
    ABI_SIZE(gc_options),
    ABI_FIELD(gc_options, client_name),
    ABI_FIELD(gc_options, deadline_ms),
    ABI_FIELD(gc_options, connect_timeout_ms),
    ABI_FIELD(gc_options, model_dir),
    ABI_FIELD(gc_options, no_local),
    ABI_FIELD(gc_options, caller_local),
    ABI_FIELD(gc_options, caller_local_len),
    ABI_FIELD(gc_options, routing_window),
    ABI_FIELD(gc_options, wait_spin_us),
    ABI_FIELD(gc_options, local_map_weights),
    ABI_SIZE(gc_layer_req),
    ABI_FIELD(gc_layer_req, layer),
    ABI_FIELD(gc_layer_req, n_tokens),
    ABI_FIELD(gc_layer_req, top_k),
    ABI_FIELD(gc_layer_req, ids),
    ABI_FIELD(gc_layer_req, weights),
    ABI_FIELD(gc_layer_req, x),
    ABI_FIELD(gc_layer_req, dtype),
    ABI_FIELD(gc_layer_req, caller_ids),
    ABI_FIELD(gc_layer_req, flags),
    ABI_SIZE(gc_cluster_info),
    ABI_FIELD(gc_cluster_info, hidden_size),
    ABI_FIELD(gc_cluster_info, intermediate_size),
    ABI_FIELD(gc_cluster_info, num_layers),
    ABI_FIELD(gc_cluster_info, num_experts),
    ABI_FIELD(gc_cluster_info, model_fingerprint),
    ABI_FIELD(gc_cluster_info, weight_format),
    ABI_FIELD(gc_cluster_info, max_tokens),
    ABI_FIELD(gc_cluster_info, n_servers),
    ABI_FIELD(gc_cluster_info, deadline_ms),
    ABI_FIELD(gc_cluster_info, local_pairs),
    ABI_FIELD(gc_cluster_info, caller_pairs),
    ABI_FIELD(gc_cluster_info, local_mapped),
    ABI_FIELD(gc_cluster_info, model_dir),
    ABI_SIZE(gc_call_timing),
    {"GC_WAIT_ACCUMULATE", GC_WAIT_ACCUMULATE},
    {"GC_REQ_PART", GC_REQ_PART},
    {"GC_REQ_FOLLOWED", GC_REQ_FOLLOWED},
};

long gc_abi_layout(const char *name) {
  if (!name) return -1;
  for (size_t i = 0; i < sizeof abi_table / sizeof abi_table[0]; i++)
    if (strcmp(abi_table[i].name, name) == 0) return (long)abi_table[i].value;
  return -1;
}
