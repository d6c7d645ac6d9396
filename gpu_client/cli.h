/*
 * gpu_client/cli.h - the subcommands of moerpc-client that live outside main.c
 * (cli_model.c: the whole-model runner's generate / logits / bench). Each takes the
 * subcommand's argv (argv[0] = its name) and returns the exit status (0 ok, 1 failure,
 * 2 usage error).
 */
#ifndef GC_CLI_H
#define GC_CLI_H

#include <stddef.h>

int gc__cli_generate(int argc, char **argv);
int gc__cli_logits(int argc, char **argv);
int gc__cli_bench(int argc, char **argv);
/* The CPU's model name from /proc/cpuinfo ("unknown" if it cannot be read). */
void gc__cpu_model(char *buf, size_t len);

#endif /* GC_CLI_H */
