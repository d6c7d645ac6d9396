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
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "placement/pl.h"

#define PROG "moerpc-place"

typedef struct pl_command {
  const char *name;
  int (*fn)(int argc, char **argv); /* argv[0] is the subcommand's name */
  const char *help;                 /* one line for `moerpc-place --help` */
} pl_command;

/* One line per subcommand; each helper's command is implemented in its own pl_*.c. */
static const pl_command commands[] = {
    {"stats", pl_cmd_stats, "collect and merge routing statistics of a running cluster"},
    {"plan", pl_cmd_plan, "plan a placement from statistics, the model and the cluster"},
    {"diff", pl_cmd_diff, "compare two placements: pairs and bytes moved per server"},
    {"simulate", pl_cmd_simulate, "project decode / prefill tokens/s of a placement on N hosts"},
    {"apply", pl_cmd_apply, "apply a placement to a running cluster live (load, switch, unload)"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " COMMAND [options]   (" PROG " COMMAND --help for its options)\n"
          "\n"
          "Expert placement for a moerpc cluster: which (layer, expert) pairs the client keeps\n"
          "and which server computes the others. Commands:\n");
  for (size_t i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
  fprintf(f, "\nExit status: 0 success, 1 failure, 2 usage error. See placement/README.md.\n");
}

int main(int argc, char **argv) {
  mr_log_set_component("place");
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < N_COMMANDS; i++)
    if (strcmp(cmd, commands[i].name) == 0) return commands[i].fn(argc - 1, argv + 1);
  fprintf(stderr, PROG ": unknown command \"%s\"\n\n", cmd);
  usage(stderr);
  return 2;
}
