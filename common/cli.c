/*
 * cli.c - the subcommand front door shared by moerpc-client and moerpc-place (mr.h):
 * `PROG COMMAND [options]`, `PROG --help`, and the same usage errors and exit codes in both.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "common/mr.h"

static void mr__cli_usage(FILE *f, const mr_cli_program *p) {
  fprintf(f, "usage: %s COMMAND [options]   (%s)\n\n%s\n", p->name, p->synopsis, p->about);
  for (size_t i = 0; i < p->n_commands; i++)
    fprintf(f, "  %-11s %s\n", p->commands[i].name, p->commands[i].summary);
  fprintf(f, "\n%s COMMAND --help describes each. Exit status: 0 ok, 1 failure, 2 usage.%s%s\n",
          p->name, p->footer ? " " : "", p->footer ? p->footer : "");
}

int mr_cli_main(const mr_cli_program *p, int argc, char **argv) {
  mr_log_set_component(p->component);
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2) {
    mr__cli_usage(stderr, p);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    mr__cli_usage(stdout, p);
    return 0;
  }
  for (size_t i = 0; i < p->n_commands; i++)
    if (strcmp(cmd, p->commands[i].name) == 0) return p->commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "%s: unknown command \"%s\"\n\n", p->name, cmd);
  mr__cli_usage(stderr, p);
  return 2;
}
