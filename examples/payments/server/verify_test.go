package main

import (
	"context"
	"log/slog"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The repository's verify command, run against this server on its three
// transports, as a user would run it against their own service: every
// check passes, and the effect (a ledger row) happened once per operation.
func TestVerifyPassesTheExampleServerOnEveryTransport(t *testing.T) {
	db := testdb.New(t, 1)
	lis, httpLis, connectLis, metricsLis, providerLis := listen(t), listen(t), listen(t), listen(t), listen(t)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() {
		stopped <- run(ctx, listeners{grpc: lis, http: httpLis, connect: connectLis, metrics: metricsLis, provider: providerLis},
			config{databaseURL: db.URL()}, slog.New(slog.DiscardHandler))
	}()
	defer requireStopped(t, stopped)
	defer cancel()

	bin := filepath.Join(t.TempDir(), "idempotency")
	build := exec.Command("go", "build", "-o", bin, "./cmd/idempotency")
	build.Dir = filepath.Join("..", "..", "..") // the repository's root
	out, err := build.CombinedOutput()
	require.NoError(t, err, string(out))

	verify := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, append([]string{"-database-url", db.URL(), "verify", "-effect-sql", "select count(*) from ledger", "-key-policy", "required"}, args...)...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "verify %v:\n%s", args, out)
		require.Contains(t, string(out), "verdict: PASS")
		return string(out)
	}
	var gout string
	require.Eventually(t, func() bool {
		cmd := exec.Command(bin, "verify", "-grpc", lis.Addr().String(), "-method", "/payments.v1.PaymentService/GetBalance", "-request", `{"account_id":"probe"}`, "-timeout", "1s")
		_ = cmd.Run()
		return cmd.ProcessState != nil // the server answers (the probe's verdict does not matter)
	}, 10*time.Second, 100*time.Millisecond)
	gout = verify("-grpc", lis.Addr().String(), "-method", "/payments.v1.PaymentService/Charge", "-request", `{"account_id":"verify-grpc","amount_cents":5}`)
	hout := verify("-http", "http://"+httpLis.Addr().String()+"/v1/charges", "-d", `{"account_id":"verify-http","amount_cents":5}`,
		"-H", "Authorization: Bearer demo-token-alice", "-H2", "Authorization: Bearer demo-token-bob")
	cout := verify("-http", "http://"+connectLis.Addr().String()+"/payments.v1.PaymentService/Charge", "-d", `{"accountId":"verify-connect","amountCents":5}`,
		"-other-body", `{"accountId":"verify-connect","amountCents":6}`,
		"-H", "Authorization: Bearer demo-token-alice", "-H2", "Authorization: Bearer demo-token-bob")
	t.Log("\n" + gout + "\n" + hout + "\n" + cout)
	require.Contains(t, hout, "callers apart")
}
