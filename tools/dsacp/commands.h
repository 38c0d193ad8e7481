// The CLI's subcommands; each returns the process exit code (0 ok, 1 failure, 2 usage error).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "args.h"
#include "dsacp/cp_step.h"

namespace dsacp::cli {

int cmd_run(const std::vector<std::string>& args);
int cmd_replay(const std::vector<std::string>& args);
int cmd_make_case(const std::vector<std::string>& args);

// Layout flags that later releases add, refused with a clear message until then.
std::map<std::string, std::string> layout_flags_not_yet();
// The layout options of replay and run (--pcp, --interleave, --pcp-decode) and their reading.
std::vector<OptionSpec> layout_options();
Result<CpLayout> read_layout(const ParsedArgs& args);

// Prints "dsacp <cmd>: error: <message>" to stderr and returns the exit code for the status
// (2 for invalid arguments, 1 otherwise).
int report_error(const std::string& command, const Status& status);

}  // namespace dsacp::cli
