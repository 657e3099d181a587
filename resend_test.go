package idempotency_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// replicaChildEnv, when set to a schema, makes the test binary serve the
// suite's ledger as one replica of a service on that schema: a process of
// its own, on a port it prints ("ready <address>").
const replicaChildEnv = "IDEMPOTENCY_REPLICA_CHILD"

// Two replicas, each a process of its own, on one database. A charge
// commits on the first and its response is lost on the way back; a proxy
// in front of the service resends the identical request, every header and
// marker as first sent (idempotency-key-new of the previous release
// included, no retry marker), to the second. The second answers with the
// stored response, and the handler does not run again: every run of it is
// counted, a run that rolls back included.
func TestResendToAnotherReplicaProcessReplays(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	_, err := db.Pool.Exec(context.Background(), `CREATE TABLE runs (key text NOT NULL)`)
	require.NoError(t, err)
	a, b := startReplicaProcess(t, db.Schema), startReplicaProcess(t, db.Schema)

	proxy, err := faultproxy.New(a)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	proxy.DropNextResponse()
	sent := metadata.Pairs(idempotency.MetadataKey, "charge-42", "idempotency-key-new", "true", "x-request-id", "req-42")
	ctx := metadata.NewOutgoingContext(context.Background(), sent)
	first := invoke(ctx, dial(t, proxy.Addr()), methodCharge, "charge 42")
	require.Equal(t, codes.Unavailable, status.Code(first.err), "the response is lost: %v", first.err)
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`), "after the commit")

	resent := invoke(ctx, dial(t, b), methodCharge, "charge 42")
	require.NoError(t, resent.err)
	require.True(t, resent.replayed, "the stored response")
	var id int64
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT id FROM ledger`).Scan(&id))
	require.Equal(t, fmt.Sprintf("charge 42#%d", id), resent.resp.GetValue(), "the first run's own response")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM runs`), "the handler ran once, on the first replica")
	requireKeysMatchLedger(t, db)
}

// startReplicaProcess starts a replica process on schema and returns its
// address; it is killed when the test ends.
func startReplicaProcess(t *testing.T, schema string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), replicaChildEnv+"="+schema)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	ready := make(chan string, 1)
	go func() {
		s := bufio.NewScanner(out)
		for s.Scan() {
			if addr, ok := strings.CutPrefix(s.Text(), "ready "); ok {
				ready <- addr
			}
		}
	}()
	select {
	case addr := <-ready:
		return addr
	case <-exited:
		t.Fatalf("replica process exited before it was ready\n%s", stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("replica process not ready after 30s\n%s", stderr.String())
	}
	return ""
}

// runReplicaChild is a replica process of TestResendToAnotherReplicaProcessReplays:
// the suite's ledger handler, which first records that it ran, outside the
// call's transaction, so that every run is counted, one that rolls back
// included.
func runReplicaChild() int {
	schema := os.Getenv(replicaChildEnv)
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		key, _ := idempotency.IncomingKey(ctx)
		if _, err := pool.Exec(ctx, `INSERT INTO runs (key) VALUES ($1)`, key); err != nil {
			return nil, err
		}
		return keyedLedger(ctx, req)
	}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fmt.Println("ready", lis.Addr().String())
	if err := srv.Serve(lis); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	return 0
}
