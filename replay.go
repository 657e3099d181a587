package idempotency

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/status" // google.rpc.Status, the stored form of a final error
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// record is a key's row.
type record struct {
	method       string
	fingerprint  []byte
	state        string
	responseType *string
	response     []byte
	status       []byte
	metadata     []byte
	expired      bool
}

// stateRunning is the state of a key's claim, which the call's result
// replaces in the same transaction: a committed row in it is a claim that
// its handler committed itself (see statements.abandon).
const stateRunning = "running"

// scanRecord reads a key's row, as the statements select it (see
// renderStatements: its bytea columns in base64), after the columns of
// before; rec is nil when the key has no row.
func scanRecord(row pgx.Row, before ...any) (*record, error) {
	var method, state *string // NULL when an outer join found no row
	var fingerprint, response, status, metadata *string
	var rec record
	var expired *bool
	dest := append(before, &method, &fingerprint, &state, &rec.responseType, &response, &status, &metadata, &expired)
	err := row.Scan(dest...)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, err
	case method == nil:
		return nil, nil
	}
	rec.method, rec.state, rec.expired = *method, *state, *expired
	for _, c := range []struct {
		dst *[]byte
		src *string
	}{{&rec.fingerprint, fingerprint}, {&rec.response, response}, {&rec.status, status}, {&rec.metadata, metadata}} {
		if *c.dst, err = decodeBase64(c.src); err != nil {
			return nil, err
		}
	}
	return &rec, nil
}

// decodeBase64 decodes a bytea column read as base64 text (which
// PostgreSQL breaks into lines; the decoder skips line ends); nil for
// NULL.
func decodeBase64(s *string) ([]byte, error) {
	if s == nil {
		return nil, nil
	}
	b, err := base64.StdEncoding.DecodeString(*s)
	if err != nil {
		return nil, fmt.Errorf("idempotency: a stored value does not decode: %w", err)
	}
	return b, nil
}

// replay answers a call with its key's stored result: the response, or the
// final error, as the first call returned them; ErrKeyReused when the key
// belongs to another method or request.
func (c *callRun) replay(rec record) (result, error) {
	if rec.method != c.call.Method || !sameRequest(rec.fingerprint, c.call.Fingerprint) {
		detail := ""
		if rec.method != c.call.Method {
			detail = "key belongs to method " + rec.method
		}
		return result{Result: Result{Outcome: OutcomeKeyReused}}, ErrKeyReused.with(detail, nil).about(c.call.Key)
	}
	res := result{Result: Result{Outcome: OutcomeReplayed}, metadata: rec.metadata}
	if rec.responseType != nil && *rec.responseType != "" {
		m, err := c.decodeResponse(*rec.responseType, rec.response)
		if err != nil {
			return res, err
		}
		res.Response = m
	}
	switch rec.state {
	case "succeeded":
		return res, nil
	case "failed":
		st := &status.Status{}
		if err := proto.Unmarshal(rec.status, st); err != nil {
			return res, grpcstatus.Errorf(codes.Internal, "idempotency: stored status of key %q: %v", c.call.Key, err)
		}
		return res, storedFinal(grpcstatus.FromProto(st))
	default:
		// A claim, which settle turns into its error before anyone replays
		// it; here only if another writer's row took its place meanwhile.
		return result{Result: Result{Outcome: OutcomeInProgress}}, inProgress("", c.s.opts.retryDelay)
	}
}

// decodeResponse decodes a stored response with the type the call's method
// declares, when the transport knows it (a dynamic type included), else
// with the type of that name linked into the binary, else as a message of
// that name whose fields are all unknown (see Result.Response): a stored
// result replays in every process that serves the method. A stored type
// that is not the declared one (the method's output changed since the call
// ran) is an error, never bytes decoded as another type.
func (c *callRun) decodeResponse(typeName string, b []byte) (proto.Message, error) {
	mt := c.tp.responseType
	switch {
	case mt == nil:
		var err error
		if mt, err = protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(typeName)); err != nil {
			mt = opaqueType(protoreflect.FullName(typeName))
		}
	case string(mt.Descriptor().FullName()) != typeName:
		return nil, grpcstatus.Errorf(codes.Internal, "idempotency: the stored response of key %q is a %s, but %s now returns %s (the method changed since the call ran); it cannot be replayed",
			c.call.Key, typeName, c.call.Method, mt.Descriptor().FullName())
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(b, m); err != nil {
		return nil, grpcstatus.Errorf(codes.Internal, "idempotency: the stored response of key %q does not decode as a %s: %v", c.call.Key, typeName, err)
	}
	return m, nil
}

// opaqueTypes caches opaqueType by name.
var opaqueTypes sync.Map // protoreflect.FullName -> protoreflect.MessageType

// opaqueType returns a message type named name that declares no fields:
// stored bytes decoded with it are all kept as unknown fields, and marshal
// back to themselves. It stands in for a response type this process does
// not know.
func opaqueType(name protoreflect.FullName) protoreflect.MessageType {
	if mt, ok := opaqueTypes.Load(name); ok {
		return mt.(protoreflect.MessageType)
	}
	fdp := &descriptorpb.FileDescriptorProto{
		Name:        proto.String("idempotency/opaque/" + string(name) + ".proto"),
		Syntax:      proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String(string(name.Name()))}},
	}
	if pkg := name.Parent(); pkg != "" {
		fdp.Package = proto.String(string(pkg))
	}
	fd, err := protodesc.NewFile(fdp, new(protoregistry.Files))
	if err != nil {
		// Not a valid message name: keep the bytes all the same, under the
		// name of a message with no fields of its own.
		fdp.Package, fdp.MessageType[0].Name = proto.String("idempotency.opaque"), proto.String("Response")
		fd, _ = protodesc.NewFile(fdp, new(protoregistry.Files))
	}
	mt, _ := opaqueTypes.LoadOrStore(name, dynamicpb.NewMessageType(fd.Messages().Get(0)))
	return mt.(protoreflect.MessageType)
}

// marshalStatus encodes a final error for storage. Its message must be
// valid UTF-8 to be encoded at all, so an invalid one is repaired first.
func marshalStatus(st *grpcstatus.Status) ([]byte, error) {
	return proto.Marshal(sanitizeStatus(st.Proto()))
}

// sanitizeStatus replaces each invalid UTF-8 sequence of the message with
// U+FFFD, which protobuf requires of a string field.
func sanitizeStatus(p *status.Status) *status.Status {
	if !utf8.ValidString(p.GetMessage()) {
		p.Message = strings.ToValidUTF8(p.GetMessage(), "\uFFFD")
	}
	return p
}
