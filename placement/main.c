/*
 * moerpc-place - the command-line face of placement/: one subcommand per job, each in its own
 * file of the module (placement/README.md):
 *
 *   moerpc-place stats    --cluster FILE [...]   collect routing statistics (moerpc-stats JSON)
 *   moerpc-place plan     --model DIR --cluster FILE [--stats FILE] [...]   plan a placement
 *   moerpc-place diff     A.json B.json [--model DIR]   compare two placements
 *   moerpc-place simulate --model DIR [...]      tokens/s of a placement from measured inputs
 *   moerpc-place apply    --cluster FILE PLAN    apply a placement live (pl_apply.c)
 *
 * Every subcommand takes --help. Exit status: 0 success, 1 failure, 2 usage error. Lifecycle
 * lines go to stderr through mr_log; results to stdout or -o FILE.
 */
#include "placement/pl.h"

#define PROG "moerpc-place"

/* One line per subcommand; each command is implemented in its own pl_*.c. */
static const mr_cli_command commands[] = {
    {"stats", pl_cmd_stats, "collect and merge routing statistics of a running cluster"},
    {"plan", pl_cmd_plan, "plan a placement from statistics, the model and the cluster"},
    {"diff", pl_cmd_diff, "compare two placements: pairs and bytes moved per server"},
    {"simulate", pl_cmd_simulate, "project decode / prefill tokens/s of a placement on N hosts"},
    {"apply", pl_cmd_apply, "apply a placement to a running cluster live (load, switch, unload)"},
};

int main(int argc, char **argv) {
  static const mr_cli_program prog = {
      .name = PROG,
      .component = "place",
      .synopsis = PROG " COMMAND --help for its options",
      .about = "Expert placement for a moerpc cluster: which (layer, expert) pairs the client keeps\n"
               "and which server computes the others. Commands:",
      .footer = "See placement/README.md.",
      .commands = commands,
      .n_commands = sizeof commands / sizeof commands[0],
  };
  return mr_cli_main(&prog, argc, argv);
}
