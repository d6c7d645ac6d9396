/*
 * gpu_client/runner/cli.h - the subcommands of moerpc-client that live outside main.c
 * (cli_model.c: the whole-model runner's generate / logits / bench; cli_serve.c: serve;
 * cli_text.c: tokenize / detokenize / chat-template). Each takes the
 * subcommand's argv (argv[0] = its name) and returns the exit status (0 ok, 1 failure,
 * 2 usage error).
 */
#ifndef GC_CLI_H
#define GC_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

int gc__cli_generate(int argc, char **argv);
int gc__cli_logits(int argc, char **argv);
int gc__cli_bench(int argc, char **argv);
int gc__cli_serve(int argc, char **argv);
/* cli_text.c: the text tools (no weights loaded) */
int gc__cli_tokenize(int argc, char **argv);
int gc__cli_detokenize(int argc, char **argv);
int gc__cli_chat_template(int argc, char **argv);
/* Parses flag's value s as a decimal integer in lo..hi into *out; otherwise prints
 * "moerpc-client: FLAG = \"S\", must be an integer in LO..HI" and returns false. */
bool gc__cli_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
bool gc__cli_u32(const char *flag, const char *s, uint32_t lo, uint32_t hi, uint32_t *out);
/* The CPU's model name from /proc/cpuinfo ("unknown" if it cannot be read). */
void gc__cpu_model(char *buf, size_t len);

#endif /* GC_CLI_H */
